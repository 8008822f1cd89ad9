"""The data cursor: draws prompts in a seeded, resumable order, one epoch after another."""
from __future__ import annotations

import random

from rlsys.types import Prompt


class PromptCursor:
    def __init__(self, prompts: list[Prompt], seed: int = 0):
        if not prompts:
            raise ValueError("the training dataset is empty: nothing to draw prompts from")
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.drawn = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        self.drawn += n
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.position, self.drawn = (
            state["seed"], state["epoch"], state["position"], state["drawn"])
        self._order = self._shuffled(self.epoch)
