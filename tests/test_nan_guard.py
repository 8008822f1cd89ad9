"""The DeepSpeed backend's own non-finite guard: without ZeRO, DeepSpeed steps on NaN gradients, so
`_optimizer_step` at stage 0 must skip the step, on every rank, when a NaN arises on one rank only.
(At ZeRO 1-3, tests/test_trainer.py's NaN test is DeepSpeed's overflow check at work, not ours.)"""
import math

import pytest
import ray
from test_trainer import SCORING, make_groups, make_trainer, max_diff, model_dir  # noqa: F401

from rlsys.trainer import worker
from rlsys.trainer.batching import build_samples

from helpers import train_step, trainer_weights


@pytest.fixture(scope="module")
def two_ranks_zero0(ray_cluster, model_dir):  # noqa: F811
    trainer = make_trainer(model_dir, backend="deepspeed", zero_stage=0, world_size=2)
    try:
        yield trainer
    finally:
        trainer.shutdown()


def one_nan_advantage(groups, advantage, *options, **named):
    """The step's samples with a NaN advantage on the first only: a sample goes to one rank, so only that
    rank's loss and local gradients are NaN (a NaN reward would spoil its whole group, on both ranks)."""
    samples = build_samples(groups, advantage, *options, **named)
    samples[0].advantage = math.nan
    return samples


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_both_at_zero0(two_ranks_zero0, monkeypatch):
    trainer = two_ranks_zero0
    before = trainer_weights(trainer)
    with monkeypatch.context() as patch:
        patch.setattr(worker, "build_samples", one_nan_advantage)  # the driver builds and splits the samples
        per_rank = ray.get(trainer.start_train_step(make_groups(2)))
    assert [math.isfinite(m["loss"]) for m in per_rank].count(False) == 1  # the NaN was on one rank
    assert [m["skipped_steps"] for m in per_rank] == [1, 1]
    assert max_diff(trainer_weights(trainer), before) == 0.0
    assert train_step(trainer, make_groups(3))["skipped_steps"] == 1  # a clean step trains
    assert max_diff(trainer_weights(trainer), before) > 0.0
