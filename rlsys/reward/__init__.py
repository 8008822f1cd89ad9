"""Rewards: the registry of reward functions and the Ray actor pool that scores completions."""
from rlsys.reward.registry import REWARDS, overlong_penalty, register_reward, score
from rlsys.reward import code  # noqa: F401  registers code_tests

__all__ = ["REWARDS", "RewardPool", "RewardResult", "overlong_penalty", "register_reward", "score"]


def __getattr__(name: str):
    """The pool (and Ray with it) is imported when first asked for: `rlsys check` reads the registry only."""
    if name in ("RewardPool", "RewardResult"):
        from rlsys.reward import pool
        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
