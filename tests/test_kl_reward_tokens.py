"""trainer.kl.reward_level=token: each token's KL off that token's reward, under gae and reinforce_pp, against
hand-worked returns."""
import math

import pytest
import torch
from test_trainer import SCORING, make_groups, model_dir, trainer_config  # noqa: F401

from rlsys.config import Config, ConfigError, GAEConfig
from rlsys.startup import load_config
from rlsys.trainer.advantages import reinforce_pp_token_returns
from rlsys.trainer.batching import TrainSample, place_token_kl
from rlsys.trainer.critic import set_advantages
from rlsys.trainer.worker import TrainerGroup

from helpers import train_step


def sample(reward: float, tokens: int, mask=None) -> TrainSample:
    return TrainSample([2] * (2 + tokens), 2, 0.0, [0.0] * tokens, [0] * tokens, mask=mask, reward=reward)


def whitened(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_returns_take_the_kl_from_each_token_on():
    # Rewards 1 and 0; penalties 0.1, 0.2 and 0.3: returns 1 - 0.3, 1 - 0.2 and 0 - 0.3.
    got = reinforce_pp_token_returns([1.0, 0.0], [[0.1, 0.2], [0.3]], [[1, 1], [1]])
    assert [v for g in got for v in g] == pytest.approx(whitened([0.7, 0.8, -0.3]))
    # A tool's token (mask 0) has no KL and no place in the whitening; the reward still reaches the tokens before it.
    got = reinforce_pp_token_returns([1.0, 0.0], [[0.1, 0.0, 0.2], [0.3]], [[1, 0, 1], [1]])
    assert got[0][1] == 0.0
    assert [got[0][0], got[0][2], got[1][0]] == pytest.approx(whitened([0.7, 0.8, -0.3]))


def test_place_token_kl_sets_reinforce_pp_advantages_and_gae_penalties():
    samples = [sample(1.0, 2), sample(0.0, 1)]
    place_token_kl(samples, [[0.1, 0.2], [0.3]], "reinforce_pp")
    assert samples[0].token_advantages + samples[1].token_advantages == pytest.approx(whitened([0.7, 0.8, -0.3]))
    samples = [sample(1.0, 3)]
    place_token_kl(samples, [[0.1, 0.2, 0.3]], "gae")
    assert samples[0].kl_penalties == [0.1, 0.2, 0.3] and samples[0].reward == 1.0


@pytest.mark.parametrize("gamma, returns", [
    (1.0, [1 - 0.6, 1 - 0.5, 1 - 0.3]),  # each token's return: the reward less the KL from it on
    (0.5, [-0.1 + 0.5 * (-0.2 + 0.5 * 0.7), -0.2 + 0.5 * 0.7, 0.7]),  # discounted, r_t = -0.1, -0.2, 1 - 0.3
])
def test_gae_takes_each_token_s_kl_as_its_reward(gamma, returns):
    samples = [sample(1.0, 3), sample(0.0, 2)]
    samples[0].kl_penalties, samples[1].kl_penalties = [0.1, 0.2, 0.3], [0.0, 0.0]
    values = [[0.0] * 3, [0.0] * 2]  # no critic yet: the advantage is the return
    set_advantages(samples, values, GAEConfig(gamma=gamma, lam=1.0), lambda stats: stats)
    assert samples[0].returns == pytest.approx(returns)
    assert samples[0].token_advantages + samples[1].token_advantages == pytest.approx(whitened(returns + [0.0, 0.0]))


def test_token_level_needs_the_kl_in_the_reward():
    with pytest.raises(ConfigError, match=r"trainer\.kl\.reward_level places the KL in the reward"):
        load_config(None, ["trainer.kl.estimator=k1", "trainer.kl.coef=0.1", "trainer.kl.reward_level=token"])


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["gae", "reinforce_pp"])
def test_a_step_with_token_kl_in_the_reward_trains(ray_cluster, model_dir, advantage):  # noqa: F811
    kl = {"estimator": "k1", "coef": 0.1, "in_reward": True, "reward_level": "token"}
    trainer = TrainerGroup(Config(trainer=trainer_config(backend="torch", advantage=advantage, kl=kl)), model_dir,
                           SCORING)
    try:
        metrics = train_step(trainer, make_groups(0))
    finally:
        trainer.shutdown()
    assert math.isfinite(metrics["loss"]) and metrics["reward_kl"] != 0.0 and torch.isfinite(
        torch.tensor(metrics["grad_norm"]))
