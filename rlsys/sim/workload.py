"""A synthetic RL workload: prompts with a latent length scale, correlated heavy-tailed samples,
rewards and reward latencies.

A prompt's traits are fixed by (seed, prompt). The samples of one Submit are drawn from a stream
keyed by (seed, prompt, ordinal of its first sample), so schedulers that submit a prompt's samples
together see the same first samples: common random numbers keep their comparison fair.
"""
from __future__ import annotations

import math
import random
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from rlsys.sim.config import RewardSpec, WorkloadSpec
from rlsys.types import Prompt

NORMAL = NormalDist()


class PromptTraits(NamedTuple):  # named tuples: cheap to build by the hundred thousand
    prompt_tokens: int
    log_scale: float  # mean log response length of this prompt
    success: float  # chance that one sample is correct
    reward_kind: str


class SampleDraw(NamedTuple):
    length: int
    truncated: bool
    reward: float
    reward_latency: float


class Workload:
    def __init__(self, spec: WorkloadSpec, reward: RewardSpec, seed: int):
        self.spec, self.reward, self.seed = spec, reward, seed
        self.sigma_prompt = spec.sigma * math.sqrt(spec.prompt_share)
        self.sigma_sample = spec.sigma * math.sqrt(1 - spec.prompt_share)
        total = sum(k.share for k in reward.kinds.values())
        self._kind_cdf, acc = [], 0.0
        for name, kind in reward.kinds.items():
            acc += kind.share / total
            self._kind_cdf.append((acc, name))
        self._prompts: list[Prompt] = []
        self._traits = self._draw_traits()

    def prompts(self) -> list[Prompt]:
        if not self._prompts:
            self._prompts = [Prompt(f"sim-{i}", "", "", index=i) for i in range(self.spec.dataset_size)]
        return self._prompts

    def traits(self, prompt: Prompt) -> PromptTraits:
        return self._traits[prompt.index]

    def _draw_traits(self) -> list[PromptTraits]:
        """Every prompt's traits at once (vectorised: datasets reach 10^5 prompts)."""
        s, n = self.spec, self.spec.dataset_size
        rng = np.random.default_rng([self.seed, 1])
        tokens = np.clip(np.rint(s.prompt_tokens * np.exp(0.5 * rng.standard_normal(n))), 1, s.max_prompt_tokens)
        scale = math.log(s.median_tokens) + self.sigma_prompt * rng.standard_normal(n)
        # Beta(m, 1-m): U-shaped, so many groups are all right or all wrong, as in RL practice.
        m = s.success_rate
        success = np.full(n, m) if m in (0.0, 1.0) else rng.beta(m, 1 - m, n)
        kinds = np.searchsorted([acc for acc, _ in self._kind_cdf], rng.random(n))
        names = [name for _, name in self._kind_cdf]
        return [PromptTraits(int(t), sc, su, names[min(k, len(names) - 1)]) for t, sc, su, k in
                zip(tokens.tolist(), scale.tolist(), success.tolist(), kinds.tolist())]

    def samples(self, prompt: Prompt, first: int, n: int) -> list[SampleDraw]:
        """Samples `first` .. `first + n - 1` of this prompt."""
        rng = random.Random(f"sample:{self.seed}:{prompt.index}:{first}")
        traits = self.traits(prompt)
        return [self._draw(rng, traits, traits.log_scale + self.sigma_sample * rng.gauss(0, 1)) for _ in range(n)]

    def resumed(self, prompt: Prompt, first: int, done: int) -> SampleDraw:
        """A sample that already has `done` tokens: its length is drawn conditioned on exceeding them."""
        rng = random.Random(f"resume:{self.seed}:{prompt.index}:{first}")
        traits = self.traits(prompt)
        if self.sigma_sample > 0:
            low = NORMAL.cdf((math.log(done + 1) - traits.log_scale) / self.sigma_sample)
            u = low + (1 - low) * rng.random()
            z = NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
            log_len = traits.log_scale + self.sigma_sample * z
        else:
            log_len = traits.log_scale
        draw = self._draw(rng, traits, log_len)
        length = min(self.spec.max_tokens, max(draw.length, done + 1))
        return SampleDraw(length, length >= self.spec.max_tokens, draw.reward, draw.reward_latency)

    def _draw(self, rng: random.Random, traits: PromptTraits, log_len: float) -> SampleDraw:
        cap = self.spec.max_tokens
        runaway = rng.random() < self.spec.runaway_share  # loops until the cap
        length = cap if runaway else min(cap, max(1, round(math.exp(min(log_len, 50.0)))))
        truncated = length >= cap
        correct = rng.random() < traits.success and not truncated
        kind = self.reward.kinds[traits.reward_kind]
        latency = kind.median_s * math.exp(kind.sigma * rng.gauss(0, 1))
        if kind.timeout_s is not None:
            latency = min(latency, kind.timeout_s)
        return SampleDraw(length, truncated, float(correct), latency)
