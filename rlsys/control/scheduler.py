"""Schedulers: pure policies that turn events into actions (docs/design.md principle 1, "Where the parts meet").

Events: a step starts (`start`: at the run's start, after a restore and after each step boundary), a
sample finished and was scored (`on_sample`), a request was aborted (`on_abort`), the trainer trained a
step and every engine serves its weights (`on_trained`, the step boundary). Actions: Submit, Abort,
Accumulate, Train. No ray, torch or vllm here, so the live controller, the simulator and the tests all
drive the very same classes.
"""
from __future__ import annotations

from rlsys.config import ControlConfig
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.events import Aborted, Scored
from rlsys.control.ledger import Ledger
from rlsys.control.selection import LengthSelection, version_counts  # noqa: F401 (schedulers import it from here)
from rlsys.control.sizing import GroupSizer
from rlsys.data.cursor import PromptCursor
from rlsys.registry import Registry
from rlsys.types import Completion, Group, Prompt, ScoredSample

Action = Submit | Abort | Accumulate | Train


def informative(group: Group) -> bool:
    """Not every reward of the group is the same: DAPO dynamic sampling keeps only such groups."""
    return len(set(group.rewards)) > 1


class GroupBuilder:
    """Collects the samples of one prompt until `size` of them have finished."""

    def __init__(self, prompt: Prompt, size: int):
        self.prompt, self.size = prompt, size
        self.samples: list[ScoredSample] = []

    def add(self, sample: ScoredSample) -> None:
        self.samples.append(sample)

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.size

    def group(self) -> Group:
        return Group(self.prompt, self.samples[: self.size])


class Scheduler:
    def __init__(self, cfg: ControlConfig, cursor: PromptCursor, sizer: GroupSizer):
        self.cfg, self.cursor, self.sizer = cfg, cursor, sizer
        self.ledger = Ledger()
        self.selection = LengthSelection()  # what it trains against what its policy generates
        self.version = 0
        self._next_request = 0
        self.prompt_of: dict[str, str] = {}  # request id -> prompt uid, for requests in flight

    # --- events ---------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        raise NotImplementedError

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        raise NotImplementedError

    def on_trained(self, version: int, groups: list[Group]) -> None:
        """The step boundary: the trainer trained `groups` and every engine serves `version`. The sizer observes
        the step and the ledger must balance. A driver logs and checkpoints here; `start` begins the next step,
        as it does after a restore, so a resumed run goes on exactly as an uninterrupted one."""
        self.sizer.observe(groups)
        self.selection.trained(groups, version)
        self.version = version
        self.ledger.check(self.in_flight_prompts())

    def on_abort(self, completion: Completion, now: float) -> list[Action]:
        """An aborted request's partial output (tokens, log-probs, versions), e.g. to resume it later."""
        self.finish(completion.request_id)
        return []

    def handle(self, event: Scored | Aborted, now: float) -> list[Action]:
        """A driver's event pump hands its events here; every sample that comes back is seen by the length
        selection's accounting, whatever the scheduler does with it."""
        if isinstance(event, Scored):
            self.selection.seen(event.sample.completion, self.version)
            return self.on_sample(event.sample, now)
        if isinstance(event, Aborted):
            self.selection.seen(event.completion, self.version)
            return self.on_abort(event.completion, now)
        raise TypeError(f"a scheduler handles Scored and Aborted events, not {event!r}")

    # --- helpers ------------------------------------------------------------------------
    def draw(self, n: int) -> list[Prompt]:
        prompts = self.cursor.take(n)
        self.ledger.draw(n)
        return prompts

    def submit(self, prompt: Prompt, n: int) -> Submit:
        ids = [f"{prompt.uid}#{self._next_request + i}" for i in range(n)]
        self._next_request += n
        self.prompt_of.update((i, prompt.uid) for i in ids)
        return Submit(prompt, ids)

    def finish(self, request_id: str) -> str | None:
        """Forget a finished or aborted request; returns its prompt uid, None if it was not ours."""
        return self.prompt_of.pop(request_id, None)

    def in_flight_prompts(self) -> int:
        raise NotImplementedError

    # --- DAPO dynamic sampling --------------------------------------------------------------
    def drop_uninformative(self, group: Group) -> bool:
        """Under dynamic sampling, count a group whose rewards are all equal as dropped; True if it is."""
        if self.cfg.dynamic_sampling.enabled and not informative(group):
            self.ledger.drop("zero_variance")
            return True
        return False

    def metrics(self) -> dict[str, float]:
        return {**self.ledger.metrics(), **self.sizer.metrics(), **self.selection.metrics()}

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Schedulers are checkpointed at step boundaries, with nothing in flight."""
        return {"ledger": self.ledger.state_dict(), "version": self.version,
                "next_request": self._next_request, "cursor": self.cursor.state_dict(),
                "sizer": self.sizer.state_dict(), "selection": self.selection.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state["ledger"])
        self.version, self._next_request = state["version"], state["next_request"]
        self.cursor.load_state_dict(state["cursor"])
        self.sizer.load_state_dict(state["sizer"])
        if "selection" in state:  # checkpoints from before it have none
            self.selection.load_state_dict(state["selection"])


SCHEDULERS: Registry[type[Scheduler]] = Registry("scheduler")
