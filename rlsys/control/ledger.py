"""Accounting of prompts: every prompt drawn is trained, still in flight, or dropped for a counted reason."""
from __future__ import annotations

from collections import Counter


class Ledger:
    def __init__(self):
        self.drawn = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()

    def draw(self, n: int) -> None:
        self.drawn += n

    def train(self, n: int) -> None:
        self.trained += n

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def check(self, in_flight: int) -> None:
        accounted = self.trained + sum(self.dropped.values()) + in_flight
        if accounted != self.drawn:
            raise AssertionError(
                f"prompt accounting broken: drawn {self.drawn} != trained {self.trained} + dropped "
                f"{dict(self.dropped)} + in flight {in_flight}")

    def metrics(self) -> dict[str, float]:
        out = {"prompts/drawn": self.drawn, "prompts/trained": self.trained}
        out.update({f"prompts/dropped_{k}": v for k, v in self.dropped.items()})
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "trained": self.trained, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        self.drawn, self.trained = state["drawn"], state["trained"]
        self.dropped = Counter(state["dropped"])
