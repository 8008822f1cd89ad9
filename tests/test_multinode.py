"""Multi-node runs on a real cluster of network namespaces (tests/multinode_harness.py): a head and a worker node
started with launch/ray_head.sh and launch/ray_worker.sh, runs submitted with launch/submit.py, and the faults
of a lost node. Each node advertises one logical GPU, so a placement plan (cluster.gpus_per_node=1) puts an
engine and a trainer rank on each; they run on the CPU."""
import json
import re
import time

import pytest

from multinode_harness import Cluster, Node, why_no_namespaces
from test_end_to_end import SMALL

pytestmark = pytest.mark.slow
SKIP = why_no_namespaces()
needs_namespaces = pytest.mark.skipif(SKIP is not None, reason=f"multi-node harness: {SKIP}")
TWO_NODES = ["cluster.nodes=2", "cluster.gpus_per_node=1", "rollout.num_workers=2", "trainer.world_size=2"]
RUN = ["configs/tiny.yaml", *SMALL, *TWO_NODES, "data.eval_size=8", "rollout.eval_samples=1",
       "rollout.eval_greedy=false"]

# Ray's view of every actor: its class, the node it ran on, the name of its placement group, its state.
ACTORS = """import json
from ray.util.state import list_actors, list_placement_groups
groups = {g.placement_group_id: g.name for g in list_placement_groups(detail=True, limit=1000)}
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
print(json.dumps([(a.class_name, ips.get(a.node_id), groups.get(a.placement_group_id), a.state)
                  for a in list_actors(detail=True, limit=1000)]))
"""


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def actors_seen_by_ray(cluster) -> list[tuple]:
    return [tuple(a) for a in json.loads(cluster.python(ACTORS).splitlines()[-1])]


def plan_addresses(output: str) -> dict[int, str]:
    """The plan printed at start-up: logical node -> the address it names."""
    return {int(n): ip for n, ip in re.findall(r"^\s*node (\d+) \(([\d.,]+)\): engines", output, re.M)}


@pytest.fixture
def cluster():
    """A fresh cluster per test: a test may kill a node, and Ray's view of the actors is then one run's."""
    with Cluster(workers=1) as c:
        yield c


@needs_namespaces
def test_a_run_spreads_over_the_nodes_as_planned_and_broadcast_weights_reach_every_engine(cluster, tmp_path):
    # weights.transfer=broadcast: gloo from trainer rank 0 on one node to the engines on both;
    # object_store crosses nodes in the fault tests below.
    out = cluster.submit(*RUN, "trainer.total_steps=2", "weights.transfer=broadcast", f"output_dir={tmp_path}")
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "done: step 2" in log, log[-4000:]
    # Step 2 trained on samples that engine 1, on the worker node, generated with version 1's weights.
    assert [r["policy_version"] for r in rows(tmp_path / "metrics.jsonl") if "samples" in r] == [1, 2]

    printed = plan_addresses(log)
    assert sorted(printed.values()) == sorted(n.address for n in cluster.nodes), log[:3000]
    actors = actors_seen_by_ray(cluster)
    for node, address in printed.items():  # the plan's node n is placement group rlsys-node{n}: engine n, rank n
        assert sorted((cls, ip) for cls, ip, group, _ in actors if group == f"rlsys-node{node}") == [
            ("RolloutWorker", address), ("TrainerWorker", address)], actors


# --- a node lost mid-run ---------------------------------------------------------------------------------
# The head holds no GPU, so every engine and rank is on a worker node and any of them can be lost.
# The plan: node 0 holds engine 0 and trainer rank 0, node 1 engine 1 alone.
FAULT_RUN = [*RUN, "trainer.world_size=1", "trainer.total_steps=5", "control.save_every=1",
             "weights.transfer=object_store"]
# Four reward workers; a call's deadline well past the seconds Ray takes to declare a node dead, so that a
# lost worker's items are retried elsewhere rather than given the fallback for a timeout.
REWARDS = ["reward.num_workers=4", "reward.timeout_s=30"]


@pytest.fixture
def spare_cluster():
    """Three worker nodes for a plan of two: one spare, where Ray moves a lost node's placement group."""
    with Cluster(workers=3, head_gpus=0) as c:
        yield c


@pytest.fixture
def plan_cluster():
    """A worker node per plan node and a head with no CPU either, so that the reward workers land on the
    worker nodes: 4 of them, 3 CPUs free on each node, put at least one on each whichever Ray fills first.
    The test adds a spare once a node is lost (present earlier, it would take the reward workers first)."""
    with Cluster(workers=2, head_gpus=0, head_cpus=0) as c:
        yield c


def wait_for_run(run_dir, log, once: str = "metrics.jsonl") -> None:
    """Until the run has written `once`: by default its first eval, when every worker has started."""
    deadline = time.monotonic() + 300
    while not any(run_dir.glob(once)):
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)


def machine_of(cluster, plan_node: int, log) -> Node:
    """The machine the printed plan put `plan_node` on (test 1 checks the printout against Ray's view)."""
    address = plan_addresses(log.read_text())[plan_node]
    return next(n for n in cluster.workers if n.address == address)


@needs_namespaces
@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_lost_node_s_rollout_and_reward_workers_are_replaced_elsewhere_and_every_prompt_is_trained(
        fault, plan_cluster, tmp_path):
    """kill: the node's raylet and processes stop; cut: they run on, unreachable, until Ray's health check
    declares the node dead."""
    cluster, run_dir, log = plan_cluster, tmp_path / "run", tmp_path / "job.log"
    job = cluster.submit_background(*FAULT_RUN, *REWARDS, f"output_dir={run_dir}", log=log)
    try:
        wait_for_run(run_dir, log)
        lost = machine_of(cluster, 1, log)
        if fault == "kill":
            lost.kill()
        else:
            cluster.cut(lost)
        cluster.add_worker()  # the spare, where Ray moves the lost node's placement group
        assert job.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        job.kill()
    text = log.read_text()
    assert "done: step 5" in text and "rollout worker 1 died" in text, text[-4000:]
    steps = [r for r in rows(run_dir / "metrics.jsonl") if "samples" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and all(r["samples"] == 16 for r in steps), steps
    # The ledger: every prompt drawn was trained (or dropped for a counted reason), every sample scored by
    # its reward function (retried on another worker if its own was lost), none given the fallback.
    last = steps[-1]
    dropped = sum(v for k, v in last.items() if k.startswith("prompts/dropped_"))
    assert last["prompts/trained"] == 5 * 4 == last["prompts/drawn"] - dropped and last["reward/errors"] == 0, last
    # Ray's view: a reward worker ran on the lost node; on the nodes left ran engine 0, engine 1's replacement,
    # the reward workers that were there and the lost ones' replacements.
    actors = actors_seen_by_ray(cluster)
    assert ("RewardWorker", lost.address, "DEAD") in [(cls, ip, state) for cls, ip, _, state in actors], actors
    left = [cls for cls, ip, _, _ in actors if ip not in (None, lost.address)]
    assert left.count("RolloutWorker") == 2 and left.count("RewardWorker") >= 4, actors


@needs_namespaces
def test_a_lost_trainer_rank_stops_the_run_naming_it_and_resume_goes_on(spare_cluster, tmp_path):
    log = tmp_path / "job.log"
    job = spare_cluster.submit_background(*FAULT_RUN, f"output_dir={tmp_path / 'run'}", log=log)
    try:
        # Any finished checkpoint (step_NNNNNN, not a .tmp being written): only the last two are kept, so a
        # given one may come and go between two polls.
        wait_for_run(tmp_path / "run", log, once="checkpoints/step_[0-9][0-9][0-9][0-9][0-9][0-9]")
        machine_of(spare_cluster, 0, log).kill()
        assert job.wait(timeout=400) != 0
    finally:
        job.kill()
    stopped = [line for line in log.read_text().splitlines() if line.startswith("rlsys: ")]  # the clear message
    assert stopped and "trainer rank" in stopped[-1], log.read_text()[-4000:]

    out = spare_cluster.submit(*FAULT_RUN, f"output_dir={tmp_path / 'run'}", "--resume")
    assert out.returncode == 0 and "done: step 5" in out.stdout, (out.stdout + out.stderr)[-4000:]
    steps = [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl") if "samples" in r]
    assert steps[-1] == 5 and sorted(set(steps)) == [1, 2, 3, 4, 5], steps
