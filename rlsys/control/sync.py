"""`sync`: the veRL-style synchronous on-policy baseline.

Each step draws B prompts with G samples each, waits for every sample, trains once, and only then
starts the next step. With DAPO dynamic sampling, groups whose rewards are all equal are dropped and
extra rounds refill the batch, up to a cap.
"""
from __future__ import annotations

from rlsys.control.actions import Train
from rlsys.control.scheduler import SCHEDULERS, Action, GroupBuilder, Scheduler
from rlsys.types import Group, ScoredSample


@SCHEDULERS.register("sync")
class SyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[str, GroupBuilder] = {}
        self.ready: list[Group] = []
        self.extra_rounds = 0
        self.shape = None

    def start(self, now: float) -> list[Action]:
        self.shape = self.sizer.next_shape()
        self.extra_rounds = 0
        return self._launch(self.shape.prompts)

    def _launch(self, n_prompts: int) -> list[Action]:
        actions = []
        for prompt in self.draw(n_prompts):
            self.pending[prompt.uid] = GroupBuilder(prompt, self.shape.group_size)
            actions.append(self.submit(prompt, self.shape.group_size))
        return actions

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        uid = self.finish(sample.completion.request_id)
        if uid is None:
            return []
        builder = self.pending[uid]
        builder.add(sample)
        if not builder.complete:
            return []
        del self.pending[uid]
        group = builder.group()
        if not self.drop_uninformative(group):
            self.ready.append(group)
        return self._step_done() if not self.pending else []

    def _step_done(self) -> list[Action]:
        missing = self.shape.prompts - len(self.ready)
        if missing > 0 and self.extra_rounds < self.cfg.dynamic_sampling.max_extra_rounds:
            self.extra_rounds += 1
            return self._launch(missing)
        groups, self.ready = self.ready, []
        self.ledger.train(len(groups))
        return [Train(groups)] if groups else self.start(0.0)

    def in_flight_prompts(self) -> int:
        return len(self.pending) + len(self.ready)
