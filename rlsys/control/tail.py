"""`tail`: RollPacker's tail batching (docs/design.md "Tail batching").

Short round: draw ceil(eta_p * P) prompts with exactly R samples each. A prompt is complete when all R of its
samples have finished. When P prompts are complete the round ends: every request still running is aborted, the
unfinished prompts join the long-prompt queue (their finished samples are discarded), and the P complete groups
are trained, each whole.

Long round: once the queue holds P prompts, or its oldest prompt has waited control.tail.max_wait_steps policy
versions, the next round runs the queue's oldest P prompts (topped up with fresh ones if fewer are queued) with R
samples each, no speculation, regenerated from scratch under the current weights (fresh request ids, nothing
resumed), and trains when all have finished. With control.tail.long_round_samples set, the round keeps at most
that many samples generating and submits the next prompt's group as room frees up, so the engines' KV caches hold
the round without pre-empting.

This is RollPacker's prompt-level rule: speculation is over whole prompts, never over a prompt's samples. The
policy gradient stays unbiased because no sample is chosen by its length: a trained group holds all R samples
its prompt was given, from one policy version, so a slow (often long, often right) answer weighs in its group's
advantages as a fast one does; and a deferred prompt is not dropped but trained later, whole and on-policy, after
a bounded wait. What finish order does choose is which step a prompt trains in. (Over-sampling a prompt and
keeping its first R samples to finish would bias every group toward short answers.)

One round is one step; P and R are read from the group sizer at each round start. Prompts still queued when
training ends are reported as deferred (`prompts/deferred`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.scheduler import SCHEDULERS, Action, GroupBuilder, Scheduler
from rlsys.types import Completion, Prompt, ScoredSample


def ceil_product(eta: float, n: int) -> int:
    """ceil(eta * n), immune to float noise such as 1.1 * 10 = 11.000000000000002."""
    return math.ceil(round(eta * n, 9))


@dataclass
class Deferred:
    """A prompt waiting for a long round, and the policy version of the short round that deferred it."""
    prompt: Prompt
    since: int


@SCHEDULERS.register("tail")
class TailScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.cfg.dynamic_sampling.enabled:
            raise ValueError("control.dynamic_sampling.enabled: the tail scheduler does not support "
                             "DAPO dynamic sampling; use control.scheduler=sync for it")
        self.queue: deque[Deferred] = deque()  # long-prompt queue, oldest first
        self.shape = None
        self.long_round = False
        # The round in flight. Prompts are indexed by position, as one prompt may be drawn twice.
        self.builders: list[GroupBuilder] = []
        self.running: list[set[str]] = []  # per prompt, its requests still generating
        self.slot: dict[str, int] = {}  # request id -> prompt position
        self.complete: list[int] = []  # positions of complete prompts, in completion order
        self.unsubmitted = 0  # a bounded long round: position of the first prompt not yet submitted
        self.live = 0  # requests of the round generating
        self.counts = {"short_rounds": 0, "long_rounds": 0, "aborted_samples": 0,
                       "wasted_tokens": 0, "discarded_samples": 0}
        self.max_wait = 0  # the most policy versions a deferred prompt waited for its long round, so far

    # --- events ---------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self.shape = self.sizer.next_shape()
        p, r = self.shape.prompts, self.shape.group_size
        self.long_round = self.long_round_due(p)
        if self.long_round:
            taken = [self.queue.popleft() for _ in range(min(p, len(self.queue)))]
            self.max_wait = max([self.max_wait] + [self.version - d.since for d in taken])
            prompts = [d.prompt for d in taken] + self.draw(p - len(taken))
        else:
            prompts = self.draw(ceil_product(self.cfg.tail.eta_p, p))
        self.builders = [GroupBuilder(prompt, r) for prompt in prompts]
        self.running = [set() for _ in prompts]
        self.unsubmitted = 0
        return self._fill()

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        request_id = sample.completion.request_id
        if self.finish(request_id) is None:
            return []  # aborted by us (it finished in flight) or not ours
        i = self.slot.pop(request_id)
        self._done(i, request_id)
        builder = self.builders[i]
        builder.add(sample)
        if not builder.complete:
            return self._fill()
        self.complete.append(i)
        # trained with this round, whatever comes next
        stream = [Accumulate([builder.group()], self.shape.prompts, self.long_round)]
        if len(self.complete) < self.shape.prompts:
            return stream + self._fill()
        return stream + self._end_round()

    def on_abort(self, completion: Completion, now: float) -> list[Action]:
        self.counts["wasted_tokens"] += completion.num_tokens
        if self.finish(completion.request_id) is None:
            return []  # one we aborted
        # Aborted by the engine, not by us: replace it so that the prompt's group still gets its R samples.
        i = self.slot.pop(completion.request_id)
        self._done(i, completion.request_id)
        return [self._submit(i, 1)]

    def long_round_due(self, prompts: int) -> bool:
        """Whether a round of `prompts` prompts started now is a long one: that many are queued, or the oldest
        queued prompt has waited control.tail.max_wait_steps policy versions."""
        return bool(self.queue) and (len(self.queue) >= prompts
                                     or self.version - self.queue[0].since >= self.cfg.tail.max_wait_steps)

    # --- the round ------------------------------------------------------------------------
    def _submit(self, i: int, n: int) -> Submit:
        action = self.submit(self.builders[i].prompt, n)
        self.running[i].update(action.request_ids)
        self.slot.update((rid, i) for rid in action.request_ids)
        self.live += n
        return action

    def _done(self, i: int, request_id: str) -> None:
        self.running[i].discard(request_id)
        self.live -= 1

    def _fill(self) -> list[Action]:
        """The round's next prompts, each with its R samples: a short round's all at once, a long round's while they
        fit under long_round_samples (one group at least, so that a bound below R still makes progress)."""
        bound, r = self.cfg.tail.long_round_samples if self.long_round else None, self.shape.group_size
        actions = []
        while self.unsubmitted < len(self.builders) and (
                bound is None or self.live + r <= bound or self.live == 0):
            actions.append(self._submit(self.unsubmitted, r))
            self.unsubmitted += 1
        return actions

    def _abort(self, request_ids) -> list[Action]:
        ids = sorted(request_ids)
        for rid in ids:
            self.finish(rid)
            self._done(self.slot.pop(rid), rid)
        self.counts["aborted_samples"] += len(ids)
        return [Abort(ids)] if ids else []

    def _end_round(self) -> list[Action]:
        actions = self._abort([rid for running in self.running for rid in running])
        unfinished = [b for b in self.builders if not b.complete]
        self.queue.extend(Deferred(b.prompt, self.version) for b in unfinished)  # in draw order
        self.counts["discarded_samples"] += sum(len(b.samples) for b in unfinished)
        groups = [self.builders[i].group() for i in self.complete]
        self.ledger.train(len(groups))
        self.counts["long_rounds" if self.long_round else "short_rounds"] += 1
        self.builders, self.running, self.slot, self.complete, self.live = [], [], {}, [], 0
        return actions + [Train(groups)]

    # --- accounting -----------------------------------------------------------------------
    def in_flight_prompts(self) -> int:
        return len(self.builders) + len(self.queue)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({"tail/round": int(self.long_round), "tail/long_queue": len(self.queue),
                    "prompts/deferred": len(self.queue), "tail/max_wait": self.max_wait})
        out.update({f"tail/{k}": v for k, v in self.counts.items()})
        return out

    def state_dict(self) -> dict:
        if self.builders:
            raise RuntimeError("the tail scheduler is checkpointed between rounds, not with one in flight")
        state = super().state_dict()
        state["tail"] = {"queue": [{"prompt": asdict(d.prompt), "since": d.since} for d in self.queue],
                         "long_round": self.long_round, "counts": dict(self.counts), "max_wait": self.max_wait}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        tail = state["tail"]
        self.queue = deque(Deferred(Prompt(**d["prompt"]), d["since"]) for d in tail["queue"])
        self.long_round, self.counts, self.max_wait = tail["long_round"], dict(tail["counts"]), tail["max_wait"]
