"""Group-relative advantage estimators, one function each, selected by `trainer.advantage`.

Each takes the rewards of one group (one prompt's samples) and returns one advantage per sample.
The realised group size is used, so groups of different sizes (SAGC, dropped samples) are fine.
A group of one sample, or one whose rewards are all equal, gets zero advantages: nothing to compare.
"""
from __future__ import annotations

import math
from typing import Callable

from rlsys.registry import Registry

AdvantageFn = Callable[[list[float]], list[float]]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

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


def group_advantages(rewards: list[float], name: str) -> list[float]:
    return ADVANTAGES.get(name)(rewards) if rewards else []


class KLController:
    """The coefficient of the KL in the reward (trainer.kl.in_reward). With a target it is adaptive (Ziegler et
    al., 2019, as veRL's AdaptiveKLController): after a step of n sequences whose mean per-token KL is kl,
    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) n / horizon. Without one it stays fixed."""

    def __init__(self, coef: float, target: float | None, horizon: int):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, sequences: int) -> None:
        if self.target is not None:
            self.coef *= 1 + min(max(kl / self.target - 1, -0.2), 0.2) * sequences / self.horizon
