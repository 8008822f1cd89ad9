"""The rollout engine interface (DESIGN.md principle 4): what a rollout worker needs from an engine.

An engine holds a fixed number of slots (concurrent sequences). Requests wait until a slot frees up,
are generated token by token, and come back as Completions with per-token behaviour log-probs and
policy versions. The built-in CPU engine and the vLLM engine both implement this; the worker and
everything above it only ever see this interface.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

from rlsys.types import Completion, Request


class RolloutEngine(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a request; it starts as soon as a slot is free. Bad requests raise ValueError."""

    def validate(self, request: Request) -> None:
        """Raise ValueError, naming the request and field, if this engine can never run the request.
        Depends only on the request and the model, so a worker may call it from any thread."""

    @abstractmethod
    def step(self) -> list[Completion]:
        """Advance generation by one step; return the requests that finished during it."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> list[Completion]:
        """Cut these requests now (finish_reason "abort", tokens so far) and free their slots.

        Ids the engine does not hold (already finished, never added) are ignored.
        """

    @abstractmethod
    def has_work(self) -> bool:
        """True while any request is running or waiting."""

    @abstractmethod
    def load(self) -> dict:
        """{"running": n, "waiting": n, "slots": n}."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Swap in weights (Hugging Face names) between steps; later tokens are tagged `version`."""

    @abstractmethod
    def stats(self) -> dict:
        """Cumulative counters: decode_steps, active_slot_steps, generated_tokens, busy_s,
        saturated_tokens_per_s (None until every slot was busy at least once)."""
