"""A synthetic RL workload: prompts with a latent length scale, correlated heavy-tailed samples,
rewards and reward latencies.

A prompt's traits are fixed by (seed, prompt). The samples of one Submit are drawn from a stream
keyed by (seed, prompt, ordinal of its first sample), so schedulers that submit a prompt's samples
together see the same first samples: common random numbers keep their comparison fair.

A runaway (a sample that loops until the cap; any drawn at the cap counts as one) stays one, so that no scheduler
trains fewer of them by cutting long samples short. Resumed (a partial rollout), a sample is the same sample: its
draw goes on (`resumed`). Regenerated from scratch (tail's long round, a sample past sorted's version bound), a
cut runaway's replacement runs away too (`samples(..., runaway_at)`), its other draws its own ordinal's; the
simulator tracks which sample is which (rlsys/sim/simulator.py `_submit`). We carry the runaway status over
rather than give each prompt a runaway propensity, which needs a spread across prompts that no published trace
gives, or replay the cut sample's whole draw: the samples a schedule cuts are its longest, so a regenerated
group would be longer than a fresh one, where only looping is taken to stick to a prompt.
"""
from __future__ import annotations

import math
import random
from collections.abc import Container
from typing import NamedTuple

import numpy as np

from rlsys.sim.config import RewardSpec, WorkloadSpec
from rlsys.types import Prompt


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

    def samples(self, prompt: Prompt, first: int, n: int, runaway_at: Container[int] = ()) -> list[SampleDraw]:
        """Samples `first` .. `first + n - 1` of this prompt; those at the positions `runaway_at` replace cut
        runaways and run away too."""
        rng = random.Random(f"sample:{self.seed}:{prompt.index}:{first}")
        traits = self.traits(prompt)
        return [self._draw(rng, traits, traits.log_scale + self.sigma_sample * rng.gauss(0, 1), i in runaway_at)
                for i in range(n)]

    def resumed(self, prompt: Prompt, ordinal: int, done: int, cut: SampleDraw) -> SampleDraw:
        """The sample drawn as `cut`, cut after `done` tokens and resumed as this prompt's request `ordinal`: the
        same sample, so its draw goes on (a replay answers with the live request's length instead)."""
        length = min(self.spec.max_tokens, max(cut.length, done + 1))
        return cut._replace(length=length, truncated=length >= self.spec.max_tokens)

    def _draw(self, rng: random.Random, traits: PromptTraits, log_len: float, runaway: bool = False) -> SampleDraw:
        cap = self.spec.max_tokens
        runaway = rng.random() < self.spec.runaway_share or runaway  # loops until the cap; the coin always drawn
        length = cap if runaway else min(cap, max(1, round(math.exp(min(log_len, 50.0)))))
        truncated = length >= cap
        correct = rng.random() < traits.success and not truncated
        kind = self.reward.kinds[traits.reward_kind]
        latency = kind.median_s * math.exp(kind.sigma * rng.gauss(0, 1))
        if kind.timeout_s is not None:
            latency = min(latency, kind.timeout_s)
        return SampleDraw(length, truncated, float(correct), latency)
