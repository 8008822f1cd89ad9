"""Friction injection for the staleness-robust losses (docs/design.md "Friction"): a configured share of
training samples gets a flipped reward, or is drawn at a wrong temperature while its recorded log-probs
claim the rollout temperature (a buggy actor). Staleness, the third friction, is the async scheduler's.
Which samples is decided by a hash of (run seed, request id): reruns and resumes pick the same ones."""
from __future__ import annotations

import zlib
from dataclasses import replace

from rlsys.config import FrictionConfig
from rlsys.types import SamplingParams


class Friction:
    def __init__(self, cfg: FrictionConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.counts = {"friction/flipped_rewards": 0, "friction/wrong_temperature_samples": 0}

    def _picked(self, kind: str, request_id: str, share: float) -> bool:
        return share > 0 and zlib.crc32(f"{self.seed}:{kind}:{request_id}".encode()) / 2 ** 32 < share

    def sampling(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """The params this request is really drawn with."""
        if not self._picked("temperature", request_id, self.cfg.wrong_temperature_share):
            return params
        self.counts["friction/wrong_temperature_samples"] += 1
        return replace(params, temperature=self.cfg.wrong_temperature, logprob_temperature=params.temperature)

    def reward(self, request_id: str, reward: float) -> float:
        """The reward the trainer sees (rewards in [0, 1])."""
        if not self._picked("reward", request_id, self.cfg.reward_flip):
            return reward
        self.counts["friction/flipped_rewards"] += 1
        return 1.0 - reward
