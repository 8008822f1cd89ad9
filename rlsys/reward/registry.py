"""Reward functions by name, plus DAPO's overlong shaping and the composition used everywhere.

A reward function takes one of two forms, told apart by its parameter names:
- `fn(response: str, answer: str)`, called positionally;
- veRL's `compute_score(data_source, solution_str, ground_truth, extra_info=None)` (any function with a
  `solution_str` parameter), called by name as veRL calls it, with the row's `data_source` and `extra_info`.
Either returns a float, or, as veRL allows, a dict whose "score" is the reward. Add your own with

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

`reward.fn` may name several functions, `reward.weights` weighing each (TRL's reward_funcs and reward_weights):
the reward is the weighted sum of their values, each checked on its own, and each part is logged as
reward/<name>/mean. One of them may be `reward_model`, a learned reward model's score (rlsys/reward/model.py),
which the pool computes in batches and hands to `score_parts`.
"""
from __future__ import annotations

import inspect
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional

from rlsys.config import REWARD_MODEL, RewardConfig
from rlsys.plugins import resolve
from rlsys.registry import Registry
from rlsys.tools.format import CALL_CLOSE, RESPONSE_CLOSE

# math-verify's only warnings are about its signal-based timeouts, which rlsys turns off (see below).
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

RewardFn = Callable[..., float]  # either form (above)
REWARDS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


PLAIN_PARAMS = ("response", "answer")
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


def reward_fn(name: str) -> RewardFn:
    """The function `reward.fn` names: registered, or the user's `module:function` (imported here)."""
    return resolve(REWARDS, name, "reward.fn",
                   lambda fn: (VERL_PARAMS, True) if is_verl_style(fn) else (PLAIN_PARAMS, False))


def is_verl_style(fn: Callable) -> bool:
    """Whether `fn` is written as veRL's compute_score: it names a `solution_str` parameter."""
    try:
        return "solution_str" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): the plain form
        return False


class BadReward(ValueError):
    """A reward function returned something that is not a finite number."""


def describe(error: Exception) -> str:
    """Why a reward function failed, as the pool logs it."""
    return str(error) if isinstance(error, BadReward) else f"raised {type(error).__name__}: {error}"


@dataclass(frozen=True)
class Part:
    """One weighted part of the reward: a function, or None for the reward model (scored in batches by the pool)."""
    name: str
    fn: Optional[RewardFn]
    weight: float = 1.0

    @property
    def key(self) -> str:
        """Its metric's name, reward/<key>/mean: the function's name, without a module or file."""
        return self.name.rpartition(":")[2]


def reward_parts(cfg: RewardConfig) -> list[Part]:
    """The parts `reward.fn` names, each with its weight (1.0 unless `reward.weights` says)."""
    weights = cfg.weights or [1.0] * len(cfg.names)
    return [Part(name, None if name == REWARD_MODEL else reward_fn(name), w) for name, w in zip(cfg.names, weights)]


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


@register_reward("final_answer")
def final_answer(response: str, answer: str) -> float:
    """exact_match of what follows the last tool call (and its answer, in a whole conversation's text): a
    conversation's final answer; the whole response when no tool was called. Rewards read the model's own text,
    the tools' answers left out (Completion.model_text)."""
    return exact_match(response.rpartition(RESPONSE_CLOSE)[2].rpartition(CALL_CLOSE)[2], answer)


@register_reward("final_value")
def final_value(response: str, answer: str) -> float:
    """exact_match of the values after the last "=": a worked answer (`x1=1, k2=0`) and a direct one (`0`, no "=")
    are right alike (data.task=cot_sum)."""
    return exact_match(response.rpartition("=")[2], answer.rpartition("=")[2])


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
    """The value (or a dict's "score", as veRL allows) as a finite float within `valid_range` (if given), or
    BadReward naming what came back."""
    if isinstance(value, dict):
        if "score" not in value:
            raise BadReward(f"returned a dict without a 'score' key (keys: {', '.join(map(str, value))})")
        value = value["score"]
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadReward(f"returned {value!r}")
    if valid_range and not valid_range[0] <= value <= valid_range[1]:
        raise BadReward(f"returned {value!r}, outside reward.valid_range [{valid_range[0]:g}, {valid_range[1]:g}]")
    return float(value)


def score(cfg: RewardConfig, response: str, answer: str, num_tokens: int, fn: RewardFn | None = None,
          data_source: str = "", extra_info: dict | None = None) -> float:
    """The reward of cfg's parts (or of `fn` alone, when given): see `score_parts`."""
    parts = [Part("fn", fn)] if fn else reward_parts(cfg)
    return score_parts(cfg, parts, response, answer, num_tokens, data_source, extra_info)[0]


def score_parts(cfg: RewardConfig, parts: list[Part], response: str, answer: str, num_tokens: int,
                data_source: str = "", extra_info: dict | None = None,
                model_score: float | None = None) -> tuple[float, dict[str, float]]:
    """The reward, the weighted sum of the parts' values plus the overlong penalty when enabled, and each part's
    value by its key. A function's value (in either form) is checked against `cfg.valid_range`; the reward model's
    (`model_score`) only for being finite: a classifier's logit has no range. A failing part fails the sample,
    naming the part when there are several."""
    values = {}
    for part in parts:
        try:
            values[part.key] = (as_reward(model_score) if part.fn is None
                                else as_reward(_call(part.fn, response, answer, data_source, extra_info),
                                               cfg.valid_range))
        except Exception as e:
            if len(parts) == 1:
                raise
            raise BadReward(f"reward.fn part {part.name} {describe(e)}") from e
    reward = sum(part.weight * values[part.key] for part in parts)
    if cfg.overlong.enabled:
        reward += overlong_penalty(num_tokens, cfg.overlong.max_len, cfg.overlong.cache_len)
    return reward, values


def _call(fn: RewardFn, response: str, answer: str, data_source: str, extra_info: dict | None):
    if is_verl_style(fn):
        return fn(data_source=data_source, solution_str=response, ground_truth=answer, extra_info=extra_info)
    return fn(response, answer)
