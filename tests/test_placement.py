"""GPU placement plans for given cluster shapes, their placement groups, the printout and the errors."""
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from rlsys.config import Config, ConfigError
from rlsys.placement import PlacementError, format_plan, group_specs, idle_warning, plan_from_config, plan_placement
from rlsys.startup import load_config


def gpus_of(slots) -> list[tuple[int, int]]:
    return [(s.node, g) for s in slots for g in s.gpus]


def assert_sound(plan):
    """No engine spans nodes or shares a GPU with another engine; no two ranks share a GPU."""
    for s in plan.engines:
        assert len(s.gpus) == plan.tp and all(0 <= g < plan.gpus_per_node for g in s.gpus)
    for role in (plan.engines, plan.trainer):
        assert max(Counter(gpus_of(role)).values()) == 1
    if plan.layout == "separate":
        assert not set(gpus_of(plan.engines)) & set(gpus_of(plan.trainer))


def test_one_node_of_8_colocated():
    plan = plan_placement(1, 8, engines=8, tp=1, trainer_world=8, layout="colocated")
    assert_sound(plan)
    assert gpus_of(plan.engines) == gpus_of(plan.trainer) == [(0, g) for g in range(8)]
    specs, where = group_specs(plan)
    assert [(s.name, len(s.bundles), s.strategy) for s in specs] == [("rlsys-node0", 8, "STRICT_PACK")]
    assert where["rollout", 3] == where["trainer", 3] == ("rlsys-node0", (3,))
    assert "engines 0-7 on GPUs 0-7; trainer ranks 0-7 on GPUs 0-7" in format_plan(plan)


def test_two_nodes_separate_with_tp2_engines():
    plan = plan_placement(2, 8, engines=4, tp=2, trainer_world=8, layout="separate")
    assert_sound(plan)
    assert [(s.node, s.gpus) for s in plan.engines] == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7))]
    assert {s.node for s in plan.trainer} == {1}
    specs, where = group_specs(plan)
    assert [(len(s.bundles), s.strategy) for s in specs] == [(1, "STRICT_PACK")] * 4 + [(8, "PACK")]
    assert specs[0].bundles[0]["GPU"] == 2  # the engine actor holds both TP GPUs
    assert where["rollout", 2] == ("rlsys-rollout2", (0,)) and where["trainer", 5] == ("rlsys-trainer", (5,))
    text = format_plan(plan)
    assert "node 0: engines 0-3 on GPUs 0-7" in text and "node 1: trainer ranks 0-7 on GPUs 0-7" in text


def test_64_gpus_on_8_nodes_colocated_tp2():
    plan = plan_placement(8, 8, engines=32, tp=2, trainer_world=64)
    assert_sound(plan)
    assert Counter(s.node for s in plan.engines) == {n: 4 for n in range(8)} and plan.used_gpus == 64
    specs, _ = group_specs(plan)
    assert len(specs) == 8 and all(len(s.bundles) == 8 for s in specs)


def test_128_gpus_on_16_nodes_separate():
    # RollPacker-like: 96 rollout GPUs as 48 TP2 engines, 32 trainer ranks on the last 4 nodes.
    plan = plan_placement(16, 8, engines=48, tp=2, trainer_world=32, layout="separate")
    assert_sound(plan)
    assert {s.node for s in plan.engines} == set(range(12)) and {s.node for s in plan.trainer} == {12, 13, 14, 15}
    assert plan.used_gpus == 128 and len(format_plan(plan).splitlines()) == 17


def test_separate_layout_shares_a_node_at_gpu_granularity():
    plan = plan_placement(1, 8, engines=2, tp=2, trainer_world=4, layout="separate")
    assert gpus_of(plan.trainer) == [(0, g) for g in range(4, 8)]
    specs, _ = group_specs(plan)
    assert sum(b["GPU"] for s in specs for b in s.bundles) == 8
    assert [len(s.bundles) for s in specs] == [1, 1, 4]  # an engine's TP GPUs in one bundle: one actor holds them


def test_idle_gpus_are_named_with_the_fields_that_would_use_them():
    assert idle_warning(plan_placement(2, 8, engines=16, tp=1, trainer_world=16)) == ""
    half = idle_warning(plan_placement(2, 8, engines=16, tp=1, trainer_world=8))  # every GPU holds an engine
    assert half == ""
    tp2 = idle_warning(plan_placement(2, 4, engines=2, tp=2, trainer_world=4))
    assert "4 of 8 GPUs would sit idle (node 1: all 4)" in tp2 and tp2.endswith("set rollout.num_workers=4 and "
                                                                                "trainer.world_size=8")
    split = idle_warning(plan_placement(2, 8, engines=2, tp=2, trainer_world=2, layout="separate"))
    assert "10 of 16 GPUs would sit idle (node 0: GPUs 6-7; node 1: all 8)" in split
    assert split.endswith("raise rollout.num_workers (now 2, 2 GPU(s) each) or trainer.world_size (now 2) by 10 GPUs "
                          "in all")


# One child process, with a Ray of 16 logical GPUs, for the four tests of live actors on plans (starting and stopping
# Ray costs more than any of them does in it): a colocated plan's actors on their GPUs; once they are gone, a larger
# plan's placement groups; once those are removed, an actor holding every GPU as an unplanned engine on CUDA did, so
# that a trainer rank cannot start; with that actor gone, a run whose plan leaves a GPU idle.
ON_SIXTEEN_GPUS = textwrap.dedent("""
    import sys, ray
    from rlsys.cli import main
    from rlsys.models import prepare_model
    from rlsys.placement import Placement, plan_from_config, plan_placement
    from rlsys.rollout.manager import RolloutManager
    from rlsys.startup import load_config
    from rlsys.trainer import worker
    from rlsys.trainer.logprobs import Scoring
    ray.init(num_cpus=16, num_gpus=16, include_dashboard=False, logging_level="ERROR")

    cfg = load_config(None, ["cluster.gpus_per_node=2", "rollout.num_workers=2", "trainer.world_size=1",
                             "trainer.backend=torch", "model.warm_start.steps=30"])
    placement = Placement(plan_from_config(cfg), timeout_s=60)
    model = prepare_model(cfg)
    rollout = RolloutManager.from_config(cfg, model, placement)
    trainer = worker.TrainerGroup(cfg, str(model), Scoring.of(cfg.rollout), placement)
    print("ROLLOUT", ray.get([w.gpu_ids.remote() for w in rollout.workers]))
    print("TRAINER", ray.get([w.gpu_ids.remote() for w in trainer.workers]))
    print("FREE_GPUS", ray.available_resources().get("GPU", 0), flush=True)
    rollout.shutdown()
    trainer.shutdown()
    placement.remove()

    @ray.remote
    class Probe:
        def gpus(self):
            return ray.get_gpu_ids()

    placement = Placement(plan_placement(2, 8, 4, 2, 8, "separate"), timeout_s=30)
    probes = [Probe.options(**placement.actor_options(role, i)).remote()
              for role, n in (("rollout", 4), ("trainer", 8)) for i in range(n)]
    ids = [ray.get(p.gpus.remote()) for p in probes]
    print("ENGINE_GPUS", [len(g) for g in ids[:4]], "DISTINCT", len({g for gs in ids for g in gs}), flush=True)
    placement.remove()

    @ray.remote(num_gpus=16)
    class Engine:
        def ready(self):
            return True

    engine = Engine.remote()
    ray.get(engine.ready.remote())
    start_timeout_s, worker.START_TIMEOUT_S = worker.START_TIMEOUT_S, 3
    try:
        cfg = load_config(None, [])
        worker.TrainerGroup(cfg, "no-model", Scoring.of(cfg.rollout))
    except worker.NotScheduled as e:
        print("REFUSED", e, flush=True)
    ray.kill(engine)
    worker.START_TIMEOUT_S = start_timeout_s
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def on_sixteen_gpus(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("idle") / "run"
    return subprocess.run([sys.executable, "-c", ON_SIXTEEN_GPUS, "train", "cluster.gpus_per_node=2",
                           "trainer.backend=torch", "trainer.total_steps=1", "model.warm_start.steps=0",
                           "data.eval_size=4", "control.prompts_per_step=4", "control.group_size=4",
                           "rollout.max_new_tokens=48", f"output_dir={run_dir}"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_whose_plan_leaves_a_gpu_idle_says_so_at_start_up_and_trains_on(on_sixteen_gpus):
    """The warning comes before the run starts, and is not fatal: of its plan's 2 GPUs the run uses one."""
    out = on_sixteen_gpus
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("warning: 1 of 2 GPUs would sit idle (node 0: GPUs 1): trainer.world_size and rollout.num_workers must "
            "grow with cluster.nodes and cluster.gpus_per_node; to use all 2, set rollout.num_workers=2 and "
            "trainer.world_size=2") in out.stderr
    assert "engines 0 on GPUs 0; trainer ranks 0 on GPUs 0" in out.stdout and "done: step 1" in out.stdout


@pytest.mark.parametrize("args, message", [
    ((1, 8, 1, 16, 8, "colocated"), "rollout.tensor_parallel_size=16 would span nodes"),
    ((1, 8, 4, 2, 8, "separate"), "need 16 GPUs, more than cluster.nodes=1 x cluster.gpus_per_node=8"),
    ((1, 8, 1, 1, 9, "colocated"), "trainer.world_size=9 need 9 GPUs"),
    ((2, 8, 5, 3, 1, "colocated"), "only 2 engines of rollout.tensor_parallel_size=3 fit on a node"),
    ((1, 0, 1, 1, 1, "colocated"), "cluster.gpus_per_node must be at least 1"),
    ((1, 8, 1, 1, 1, "mixed"), "cluster.layout must be colocated or separate"),
])
def test_impossible_shapes_are_refused_by_field(args, message):
    with pytest.raises(PlacementError, match=message):
        plan_placement(*args)


def test_config_checks_the_plan_when_it_loads():
    assert plan_from_config(Config()) is None  # no GPUs: nothing to place
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=4 would span nodes"):
        load_config(None, ["cluster.gpus_per_node=2", "rollout.tensor_parallel_size=4"])
    cfg = load_config(None, ["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.layout=separate",
                             "rollout.num_workers=4", "rollout.tensor_parallel_size=2", "trainer.world_size=8"])
    assert plan_from_config(cfg) == plan_placement(2, 8, 4, 2, 8, "separate")


def test_colocated_tp_engines_are_refused_before_any_group_is_made():
    from rlsys.placement import Placement

    with pytest.raises(PlacementError, match="use cluster.layout=separate"):
        Placement(plan_placement(1, 8, engines=4, tp=2, trainer_world=8, layout="colocated"))


@pytest.mark.slow
def test_placement_groups_schedule_actors_on_their_gpus(on_sixteen_gpus):
    """Real Ray placement groups on a one-node Ray with 16 logical GPUs (in a child process)."""
    out = on_sixteen_gpus
    assert "ENGINE_GPUS [2, 2, 2, 2] DISTINCT 16" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_a_colocated_run_puts_each_engine_and_trainer_rank_on_the_gpu_the_plan_gives_them(on_sixteen_gpus):
    """The live actors (rollout workers, trainer ranks) in their placement groups, on logical GPUs."""
    out = on_sixteen_gpus
    # engine 0 and trainer rank 0 share GPU 0 (half each); engine 1 has GPU 1; nothing outside the groups: the
    # plan's 2 GPUs are all taken, the other 14 of the Ray's 16 all free
    assert "ROLLOUT [[0], [1]]" in out.stdout and "TRAINER [[0]]" in out.stdout, out.stdout + out.stderr
    assert "FREE_GPUS 14" in out.stdout


def test_an_engine_on_cuda_without_a_plan_is_refused_naming_the_field():
    """Unplanned, the engine would take the host's GPU and the trainer would wait for one forever."""
    with pytest.raises(ConfigError, match="rollout.device=cuda needs cluster.gpus_per_node >= 1"):
        load_config(None, ["rollout.device=cuda"])
    assert plan_from_config(load_config(None, ["rollout.device=cuda", "cluster.gpus_per_node=1"])).used_gpus == 1


@pytest.mark.slow
def test_a_trainer_rank_ray_cannot_schedule_is_reported_not_waited_for(on_sixteen_gpus):
    """A Ray whose GPUs another actor holds (as an unplanned engine on CUDA did): the trainer's start names what it
    asked for within its deadline."""
    out = on_sixteen_gpus
    assert "REFUSED 1 of 1 trainer rank(s) did not start within 3 s: each asks Ray for {'num_cpus': 1, " \
           "'num_gpus': 1}" in out.stdout, out.stdout + out.stderr
