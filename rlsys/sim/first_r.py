"""RollPacker's response-level rule, simulated only: the rule its published rows measure, so that the simulator
is validated against them with the algorithm they ran (rlsys/sim/calibration.py, `rlsys simulate --calibrate`).

In a short round each prompt gets ceil(eta_r R) samples, and the first R to finish are its group: the rest are
aborted at once. That trains every group without its slowest (often longest, often right) answers, a bias toward
short answers, so live tail refuses it (rlsys/control/tail.py, control.tail.eta_r) and only a simulator config may
set it (`control.tail_eta_r`). Long rounds run as tail's, R samples a prompt and no speculation.
"""
from __future__ import annotations

from types import SimpleNamespace

from rlsys.control import build_scheduler
from rlsys.control.scheduler import Action
from rlsys.control.sizing import GROUP_SIZERS
from rlsys.control.tail import TailScheduler, ceil_product
from rlsys.types import ScoredSample


class FirstRTail(TailScheduler):
    """Tail batching with RollPacker's response-level speculation on top of its prompt-level one."""

    def _fill(self) -> list[Action]:
        if self.long_round or self.unsubmitted == len(self.builders):
            return super()._fill()
        r = self.shape.group_size
        extra = ceil_product(self.cfg.tail_eta_r, r) - r
        # Every prompt's first R samples queue ahead of all the extras: an engine with fewer slots than the round
        # starts extras only as slots free up, and most are aborted before they start (RollPacker's order).
        first = [self._submit(i, r) for i in range(len(self.builders))]
        self.unsubmitted = len(self.builders)
        return first + [self._submit(i, extra) for i in range(len(self.builders)) if extra]

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        i = self.slot.get(sample.completion.request_id)
        actions = super().on_sample(sample, now)
        if i is None or not self.builders or not self.builders[i].complete:
            return actions  # not ours, the round just ended (everything aborted), or the group still fills
        return actions + self._abort(self.running[i])  # the prompt's samples beyond its first R finishers


def build(control, cursor):
    """The run's scheduler: the live one (`rlsys.control.build_scheduler`), or tail with the response-level rule
    where the simulator config sets control.tail_eta_r."""
    if getattr(control, "tail_eta_r", None) is None:
        return build_scheduler(SimpleNamespace(control=control), cursor)
    return FirstRTail(control, cursor, GROUP_SIZERS.get(control.group_sizer)(control))
