"""Advantage estimators, one function each, selected by `trainer.advantage`.

Most are group-relative: they take the rewards of one group (one prompt's samples) and return one advantage
per sample. The realised group size is used, so groups of different sizes (SAGC, dropped samples) are fine. A
group of one sample, or one whose rewards are all equal, gets zero advantages: nothing to compare. Those marked
`batch_level` see the whole step instead (`BatchAdvantageFn`): they normalise by the step's statistics, so they
need every group of the step at once.
"""
from __future__ import annotations

import math
from typing import Callable

from rlsys.registry import Registry

AdvantageFn = Callable[[list[float]], list[float]]
# (each group's rewards, each group's samples' trained token counts) -> each group's advantages
BatchAdvantageFn = Callable[[list[list[float]], list[list[int]]], list[list[float]]]
ADVANTAGES: Registry[AdvantageFn | BatchAdvantageFn] = Registry("advantage estimator")

EPS = 1e-6


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@ADVANTAGES.register("grpo")
def grpo(rewards: list[float]) -> list[float]:
    """(r_i - mean) / (std + eps) with the sample std (divide by G - 1), as torch.std computes it."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    mean = _mean(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + EPS) for r in rewards]


@ADVANTAGES.register("drgrpo")
def drgrpo(rewards: list[float]) -> list[float]:
    """Dr. GRPO: r_i - mean, no std division (which over-weights groups that are nearly solved)."""
    mean = _mean(rewards)
    return [r - mean for r in rewards]


@ADVANTAGES.register("rloo")
def rloo(rewards: list[float]) -> list[float]:
    """Leave-one-out: r_i minus the mean of the other G - 1 rewards."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


@ADVANTAGES.register("gae")
def gae(rewards: list[float]) -> list[float]:
    """PPO's (veRL's adv_estimator=gae): each token's advantage comes from the critic's values when the step
    trains (trainer/critic.py), so a sample's advantage here is unused: 0."""
    return [0.0] * len(rewards)


def batch_level(fn: BatchAdvantageFn) -> BatchAdvantageFn:
    fn.batch_level = True
    return fn


def is_batch_level(name: str) -> bool:
    return getattr(ADVANTAGES.get(name), "batch_level", False)


def step_advantages(rewards: list[list[float]], tokens: list[list[int]], name: str) -> list[list[float]]:
    """Each group's advantages, from every group's rewards and its samples' trained token counts (0: a sample that
    trains nothing, an empty response)."""
    fn = ADVANTAGES.get(name)
    if getattr(fn, "batch_level", False):
        return fn(rewards, tokens)
    return [fn(group) if group else [] for group in rewards]


def group_advantages(rewards: list[float], name: str) -> list[float]:
    """One group's advantages, the group taken as the whole step (one token per sample) by a batch-level one."""
    return step_advantages([rewards], [[1] * len(rewards)], name)[0]


def check_advantage_options(cfg) -> None:
    """Refuse a batch-level estimator where the step's groups are not all seen at once (trainer.streamed)."""
    if cfg.streamed and is_batch_level(cfg.advantage):
        raise ValueError(f"trainer.advantage={cfg.advantage} normalises by the whole step's rewards, and "
                         "trainer.streamed trains each group as it completes: use a group-relative estimator "
                         "(grpo, drgrpo, rloo) or trainer.streamed=false")


# --- batch-level: normalised by the step's statistics ----------------------------------------------
def token_whiten(values: list[float], tokens: list[int], eps: float = 1e-8) -> list[float]:
    """veRL's masked_whiten of one value per sequence repeated over its tokens: (v - mean) / sqrt(var + eps), mean
    and the Bessel-corrected variance over every token, so a long sequence weighs more. Fewer than two tokens: 0."""
    count = sum(tokens)
    if count < 2:
        return [0.0] * len(values)
    mean = sum(v * n for v, n in zip(values, tokens)) / count
    var = sum(n * (v - mean) ** 2 for v, n in zip(values, tokens)) / (count - 1)
    return [(v - mean) / math.sqrt(var + eps) for v in values]


def regroup(flat: list[float], like: list[list[float]]) -> list[list[float]]:
    out, start = [], 0
    for group in like:
        out.append(flat[start:start + len(group)])
        start += len(group)
    return out


@ADVANTAGES.register("reinforce_pp")
@batch_level
def reinforce_pp(rewards: list[list[float]], tokens: list[list[int]]) -> list[list[float]]:
    """REINFORCE++ (Hu, 2025) as veRL computes it for an outcome reward with gamma 1: each token's return is its
    sequence's reward, whitened over the step's tokens (no group baseline)."""
    flat = [r for group in rewards for r in group]
    return regroup(token_whiten(flat, [n for group in tokens for n in group]), rewards)


def reinforce_pp_token_returns(rewards: list[float], penalties: list[list[float]],
                               masks: list[list[int]]) -> list[list[float]]:
    """REINFORCE++ with the KL in each token's reward (trainer.kl.reward_level=token), as veRL's with gamma 1: a
    token's return is its sequence's reward less the penalties from that token on, whitened over the step's trained
    tokens (`masks`: 1 per trained token; a tool's token gets 0 and no place in the whitening)."""
    returns = []
    for reward, penalty in zip(rewards, penalties):
        ahead, found = 0.0, []
        for p in reversed(penalty):
            ahead += p
            found.append(reward - ahead)
        returns.append(found[::-1])
    trained = [v for found, mask in zip(returns, masks) for v, keep in zip(found, mask) if keep]
    whitened = iter(token_whiten(trained, [1] * len(trained)))
    return [[next(whitened) if keep else 0.0 for keep in mask] for mask in masks]


@ADVANTAGES.register("reinforce_pp_baseline")
@batch_level
def reinforce_pp_baseline(rewards: list[list[float]], tokens: list[list[int]]) -> list[list[float]]:
    """REINFORCE++-baseline (veRL's): the reward less its group's mean (0 for a group of one), then whitened over
    the step's tokens."""
    centred = [[r - (_mean(group) if len(group) > 1 else 0.0) for r in group] for group in rewards]
    return reinforce_pp(centred, tokens)


@ADVANTAGES.register("grpo_batch_std")
@batch_level
def grpo_batch_std(rewards: list[list[float]], tokens: list[list[int]]) -> list[list[float]]:
    """TRL's scale_rewards="batch": the reward less its group's mean, divided by the std of every reward of the
    step (Bessel-corrected, as TRL's nanstd) + 1e-4 (TRL's epsilon)."""
    flat = [r for group in rewards for r in group]
    if len(flat) < 2:
        return [[0.0] * len(group) for group in rewards]
    mean = _mean(flat)
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / (len(flat) - 1))
    return [[(r - _mean(group)) / (std + 1e-4) for r in group] for group in rewards]


class KLController:
    """The coefficient of the KL in the reward (trainer.kl.in_reward). With a target it is adaptive (Ziegler et
    al., 2019, as veRL's AdaptiveKLController): after a step of n sequences whose mean per-token KL is kl,
    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) n / horizon. Without one it stays fixed."""

    def __init__(self, coef: float, target: float | None, horizon: int):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, sequences: int) -> None:
        if self.target is not None:
            self.coef *= 1 + min(max(kl / self.target - 1, -0.2), 0.2) * sequences / self.horizon
