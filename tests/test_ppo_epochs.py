"""trainer.ppo_epochs: passes after the first score against pi_old of the step's start, in reshuffled mini-batches
that keep each sample on its rank; the critic's own mini-batches and epochs; veRL's count of critic warm-up steps."""
import random

import pytest
from test_trainer import SCORING, make_groups, model_dir, trainer_config  # noqa: F401

from rlsys.config import Config, ConfigError
from rlsys.startup import load_config
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, later_passes, pack_micro_batches, plan_step
from rlsys.trainer.critic import warming_up
from rlsys.trainer.worker import TrainerGroup, taken_from

from helpers import train_step


def one_step(model_dir, epochs: int, **overrides) -> dict:  # noqa: F811
    """One step of one mini-batch on a torch backend, its samples passed over `epochs` times."""
    backend = TorchBackend(trainer_config(ppo_epochs=epochs, **overrides), model_dir, SCORING)
    samples = build_samples(make_groups(0), "grpo")
    (mine,), totals = plan_step(samples, 1, backend.cfg.micro_batch_tokens)
    orders = [[random.Random(e).sample(range(len(mine)), len(mine))] for e in range(epochs - 1)]
    (later,) = later_passes([mine], orders, 1, backend.cfg.micro_batch_tokens)
    return backend.train_mini_batches([(mine, totals)] + taken_from(mine, later), fresh=False)


def test_the_second_pass_scores_against_the_start_and_its_clipping_is_logged(model_dir):  # noqa: F811
    once, twice = one_step(model_dir, 1, lr=5e-2), one_step(model_dir, 2, lr=5e-2)
    # The first pass runs on the weights pi_old was taken from: its ratio is exactly 1, nothing is clipped.
    assert once["clip_fraction"] == 0.0
    # The second, on moved weights against the same pi_old: its ratio leaves 1 and the clip bites (the step's
    # statistic is the mean of its updates'). Were pi_old recomputed on the moved weights, it would stay 0.
    assert twice["clip_fraction"] > 0.0
    assert twice["tokens"] == 2 * once["tokens"]  # every sample trained in each pass


def test_later_passes_keep_each_rank_s_samples_and_cover_them_once_per_pass():
    samples = build_samples(make_groups(3, prompts=5), "grpo")
    per_rank, _ = plan_step(samples, 2, 48)
    rng = random.Random(0)
    orders = [[rng.sample(range(len(mine)), len(mine)) for mine in per_rank] for _ in range(2)]
    plans = later_passes(per_rank, orders, 3, 48)
    assert len(plans[0]) == len(plans[1]) == 6  # two passes of three updates, every rank in each
    for mine, plan, index in zip(per_rank, plans, (0, 1)):
        for p in range(2):
            taken = [i for indices, _ in plan[3 * p:3 * p + 3] for i in indices]
            assert taken == orders[p][index]  # each pass: the rank's own samples, all, once, in its order
    for (a, totals), (b, same) in zip(*plans):  # one update's totals, shared by the ranks: both ranks' counts
        picked = [per_rank[0][i] for i in a], [per_rank[1][i] for i in b]
        assert totals == same and totals.sequences == len(a) + len(b)
        assert totals.tokens == sum(s.trained_tokens for p in picked for s in p)
        assert totals.micro_batches == max(len(pack_micro_batches(p, 48)) for p in picked)


def test_critic_warmup_counts_as_verl():
    # veRL trains the actor once critic_warmup <= global_steps, which starts at 1: N - 1 steps of critic alone.
    for n, alone in [(0, 0), (1, 0), (2, 1), (5, 4)]:
        assert sum(warming_up(taken, n) for taken in range(10)) == alone
        assert not warming_up(alone, n)  # and every step after trains the policy too


def test_ppo_epochs_cannot_stream():
    with pytest.raises(ConfigError, match=r"trainer\.ppo_epochs=2 needs trainer\.streamed=false"):
        load_config(None, ["control.scheduler=tail", "trainer.streamed=true", "trainer.ppo_epochs=2"])


@pytest.mark.slow
def test_ppo_with_its_own_critic_passes_through_the_trainer_group(ray_cluster, model_dir):  # noqa: F811
    cfg = trainer_config(backend="torch", advantage="gae", lr=5e-2, mini_batches=2, ppo_epochs=2,
                         critic={"lr": 1e-3, "mini_batches": 1, "ppo_epochs": 3, "lr_warmup_steps": 2})
    trainer = TrainerGroup(Config(trainer=cfg), model_dir, SCORING)
    try:
        first, second = [train_step(trainer, make_groups(seed)) for seed in (0, 1)]
    finally:
        trainer.shutdown()
    tokens = sum(s.trained_tokens for s in build_samples(make_groups(0), "gae"))
    assert first["tokens"] == 2 * tokens  # two passes of the policy over every token
    assert first["clip_fraction"] > 0.0 and first["value_loss"] > 0
    assert (first["lr"], second["lr"]) == (5e-2, 5e-2)
    assert (first["critic_lr"], second["critic_lr"]) == (0.0, 0.5e-3)  # the critic's own warm-up
