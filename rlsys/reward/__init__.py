"""Rewards: the registry of reward functions and the Ray actor pool that scores completions."""
from rlsys.reward.pool import RewardPool, RewardResult
from rlsys.reward.registry import REWARDS, overlong_penalty, register_reward, score
from rlsys.reward import code  # noqa: F401  registers code_tests

__all__ = ["REWARDS", "RewardPool", "RewardResult", "overlong_penalty", "register_reward", "score"]
