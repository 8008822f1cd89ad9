"""Reward functions by name, plus DAPO's overlong shaping and the composition used everywhere.

A reward function has one signature, `fn(response: str, answer: str) -> float`. Add your own with

    @register_reward("my_reward")
    def my_reward(response, answer): ...

and select it with `reward.fn=my_reward`, or name it in the config without registering it:
`reward.fn=my_package.rewards:my_reward` or `reward.fn=path/to/rewards.py:my_reward` (rlsys/plugins.py).
A value that is not a finite number within
`reward.valid_range` ([-1, 1] unless configured) gets the fallback reward and is counted in
`reward/errors`. Functions run in a worker thread of a reward actor, so they must not rely on
signals (signal.alarm); the pool enforces the deadline instead. A function with a
`setup(cfg: RewardConfig)` attribute gets it called once as each actor starts (code_tests, in
code.py, builds its sandbox there).
"""
from __future__ import annotations

import logging
import math
import numbers
from typing import Callable

from rlsys.config import RewardConfig
from rlsys.plugins import resolve
from rlsys.registry import Registry

# math-verify's only warnings are about its signal-based timeouts, which rlsys turns off (see below).
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


def reward_fn(name: str) -> RewardFn:
    """The function `reward.fn` names: registered, or the user's `module:function` (imported here)."""
    return resolve(REWARDS, name, "reward.fn", ("response", "answer"))


class BadReward(ValueError):
    """A reward function returned something that is not a finite number."""


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


@register_reward("math_verify")
def math_verify(response: str, answer: str) -> float:
    """1.0 if the response's final answer is mathematically equal to `answer` ("\\boxed{0.5}" vs "1/2")."""
    from math_verify import parse, verify

    # Timeouts off: signal.alarm works only in a main thread; the pool's deadline replaces them.
    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)  # bare LaTeX
    pred = parse(response, parsing_timeout=None)
    return float(bool(gold) and verify(gold, pred, timeout_seconds=None))


@register_reward("format")
def well_formed(response: str, answer: str) -> float:
    """1.0 if the response is a non-empty single line: the shape of an answer to the built-in tasks."""
    text = response.strip()
    return float(bool(text) and "\n" not in text)


def overlong_penalty(num_tokens: int, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len, then linear down to -1 at max_len."""
    soft_limit = max_len - cache_len
    if num_tokens <= soft_limit:
        return 0.0
    if num_tokens <= max_len:
        return (soft_limit - num_tokens) / cache_len
    return -1.0


def as_reward(value, valid_range: tuple[float, float] | None = None) -> float:
    """The value as a finite float within `valid_range` (if given), or BadReward naming what came back."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadReward(f"returned {value!r}")
    if valid_range and not valid_range[0] <= value <= valid_range[1]:
        raise BadReward(f"returned {value!r}, outside reward.valid_range [{valid_range[0]:g}, {valid_range[1]:g}]")
    return float(value)


def score(cfg: RewardConfig, response: str, answer: str, num_tokens: int,
          fn: RewardFn | None = None) -> float:
    """The base reward (cfg.fn, or `fn` when given), checked against `cfg.valid_range`, plus the
    overlong penalty when enabled."""
    reward = as_reward((fn or reward_fn(cfg.fn))(response, answer), cfg.valid_range)
    if cfg.overlong.enabled:
        reward += overlong_penalty(num_tokens, cfg.overlong.max_len, cfg.overlong.cache_len)
    return reward
