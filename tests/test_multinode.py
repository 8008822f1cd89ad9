"""Multi-node runs on a real cluster of network namespaces (tests/multinode_harness.py): a head and a worker node
started with launch/ray_head.sh and launch/ray_worker.sh, runs submitted with launch/submit.py, and the faults
of a lost node. Each node advertises one logical GPU, so a placement plan (cluster.gpus_per_node=1) puts an
engine and a trainer rank on each; they run on the CPU."""
import json
import re

import pytest

from multinode_harness import Cluster, why_no_namespaces
from test_end_to_end import SMALL

pytestmark = pytest.mark.slow
SKIP = why_no_namespaces()
needs_namespaces = pytest.mark.skipif(SKIP is not None, reason=f"multi-node harness: {SKIP}")
TWO_NODES = ["cluster.nodes=2", "cluster.gpus_per_node=1", "rollout.num_workers=2", "trainer.world_size=2"]
RUN = ["configs/tiny.yaml", *SMALL, *TWO_NODES, "data.eval_size=8", "rollout.eval_samples=1",
       "rollout.eval_greedy=false"]

# Ray's view of every actor: its class, the node it ran on, and the name of its placement group.
ACTORS = """
from ray.util.state import list_actors, list_placement_groups
groups = {g.placement_group_id: g.name for g in list_placement_groups(detail=True, limit=1000)}
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
print(json.dumps([(a.class_name, ips.get(a.node_id), groups.get(a.placement_group_id))
                  for a in list_actors(detail=True, limit=1000)]))
"""


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def plan_addresses(output: str) -> dict[int, str]:
    """The plan printed at start-up: logical node -> the address it names."""
    return {int(n): ip for n, ip in re.findall(r"^\s*node (\d+) \(([\d.,]+)\): engines", output, re.M)}


@pytest.fixture
def cluster():
    """A fresh cluster per test: a test may kill a node, and Ray's view of the actors is then one run's."""
    with Cluster(workers=1) as c:
        yield c


@needs_namespaces
@pytest.mark.parametrize("transfer", ["object_store", "broadcast"])
def test_a_run_spreads_over_the_nodes_as_planned_and_weights_reach_every_engine(cluster, transfer, tmp_path):
    out = cluster.submit(*RUN, "trainer.total_steps=2", f"weights.transfer={transfer}", f"output_dir={tmp_path}")
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "done: step 2" in log, log[-4000:]
    # Step 2 trained on samples that engine 1, on the worker node, generated with version 1's weights.
    assert [r["policy_version"] for r in rows(tmp_path / "metrics.jsonl") if "samples" in r] == [1, 2]

    printed = plan_addresses(log)
    assert sorted(printed.values()) == sorted(n.address for n in cluster.nodes), log[:3000]
    actors = json.loads(cluster.python("import json\n" + ACTORS).splitlines()[-1])
    for node, address in printed.items():  # the plan's node n is placement group rlsys-node{n}: engine n, rank n
        assert sorted((cls, ip) for cls, ip, group in actors if group == f"rlsys-node{node}") == [
            ("RolloutWorker", address), ("TrainerWorker", address)], actors
