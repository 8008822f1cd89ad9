"""The GPUs a bench run pays for (rlsys.bench.budget_gpus): its GPU-seconds and every per-GPU-second ratio scale by
it, so a budget read off the engine count (the trainer's GPUs forgotten) would flatter the presets that use more."""
import pytest

from rlsys.bench import budget_gpus
from rlsys.startup import load_config

EMULATED = ["emulate.gpu=h100", "emulate.model=qwen2.5-1.5b", "rollout.num_workers=2"]


@pytest.mark.parametrize("overrides, gpus", [
    ([], None),  # the CPU: no GPU to pay for
    (["emulate.gpus=4", "emulate.layout=colocated"], 4),  # the trainer on all four, beside the two engines
    (["emulate.gpus=4", "emulate.layout=separate"], 4),  # two engines, the trainer on the other two
    (["emulate.tp=2"], 2 * 2 + 8),  # legacy, emulate.gpus unset: each engine's TP GPUs, the trainer's 8 (default)
    (["emulate.trainer_gpus=2"], 2 + 2),
], ids=["cpu", "colocated", "separate", "legacy", "legacy-trainer-gpus"])
def test_a_runs_gpu_budget_counts_the_trainers_gpus_too(overrides, gpus):
    cfg = load_config(None, (EMULATED if overrides else []) + overrides)
    assert budget_gpus(cfg) == gpus


def test_a_gpu_runs_budget_is_its_placement_plans_gpus():
    cfg = load_config(None, ["cluster.gpus_per_node=4", "cluster.layout=separate", "rollout.num_workers=2",
                             "trainer.world_size=2", "rollout.device=cuda"])
    assert budget_gpus(cfg) == 4
