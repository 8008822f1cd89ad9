"""A simulated vLLM engine with continuous batching, advanced from event to event, not token by token.

Decode progress `progress` counts the steps the engine has taken: every running sequence gains one
token per step. A request admitted at progress D0 with r tokens to go finishes at D0 + r, so
finishing order is a heap, and the live KV tokens are `kv_offset + n * progress`. Between two events
the batch is fixed, the step time grows linearly with progress, and the time to advance dD steps is

    c0 * dD + c1 * dD**2 / 2,   c0 = step time now,  c1 = its growth a step (EngineCost.growth_s),

so one event costs O(log n) whatever the number of tokens (the "fluid" view: progress is real-valued).
When the KV cache is full the newest request is preempted and later recomputed (prefill of prompt
plus the tokens it has), as vLLM does.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from typing import Optional

from rlsys.costs import EngineCost

QUEUED, RUNNING, DONE, ABORTED = "queued", "running", "done", "aborted"
EPS = 1e-6  # tokens


class SimRequest:
    __slots__ = ("rid", "prompt", "prompt_tokens", "target", "truncated", "reward", "reward_latency",
                 "done", "base", "state", "engine", "key", "submit_time", "start_time", "end_time",
                 "versions", "counted")

    def __init__(self, rid, prompt, prompt_tokens, draw, submit_time, done=0):
        self.rid, self.prompt, self.prompt_tokens = rid, prompt, prompt_tokens
        self.target, self.truncated = draw.length, draw.truncated
        self.reward, self.reward_latency = draw.reward, draw.reward_latency
        self.done = float(done)  # tokens generated before the current admission
        self.counted = done  # whole tokens already attributed to a policy version
        self.base = 0.0  # engine progress at admission
        self.state, self.engine, self.key = QUEUED, None, -1
        self.submit_time, self.start_time, self.end_time = submit_time, None, None
        self.versions: list[tuple[int, int]] = []  # (policy version, tokens) runs


class SimEngine:
    def __init__(self, index: int, cost: EngineCost, max_seqs: int, watermark: float, slots: int):
        self.index, self.cost, self.max_seqs = index, cost, max_seqs
        self.gpus = 1  # the simulator sets its TP size
        self.admit_limit = (1 - watermark) * cost.kv_capacity
        self.slots = slots  # the concurrency counted as full in the bubble ratio
        self.clock = self.progress = self.kv_offset = 0.0
        self.n = self.queued = 0
        self.running: list = []  # heap of (finish progress, key, request)
        self.admitted: list = []  # (key, request) in admission order: the newest is preempted first
        self.queue: deque[SimRequest] = deque()
        self.paused_until = self.prefill_until = 0.0
        self.epoch = 0  # bumped whenever a scheduled event may be stale
        self._keys = 0
        self.mark_at, self.mark_versions = [0.0], [0]  # progress at which each weight version arrived
        self.busy_slot_s = self.alloc_s = self.kv_token_s = self.generated = 0.0
        self.idle_s = 0.0  # allocated to rollout with nothing running: room for a streamed trainer
        self.idle_spans: list[tuple[float, float]] = []  # when it was so, for counting whole trainer replicas
        self.preemptions = 0
        self.recomputed_tokens = 0.0  # prompt + generated tokens of preempted sequences, prefilled again
        self.decode_spans: Optional[list[tuple[float, float]]] = None  # a list: record when it decoded (tests)
        self.mark: Optional[SlotMark] = None  # the simulator's, shared by its engines
        self.held_stamp, self.held = -1, (0.0, 0.0)  # slot_seconds at the mark of that stamp, once run past it

    @property
    def load(self) -> int:
        return self.n + self.queued

    def live_kv(self) -> float:
        return self.kv_offset + self.n * self.progress

    # --- time --------------------------------------------------------------------------------
    def advance_to(self, t: float, target: Optional[float] = None) -> None:
        """Run until time t with the current batch (no internal event may fall before t)."""
        if t <= self.clock:
            return
        mark = self.mark
        if mark is not None and t > mark.t and self.held_stamp != mark.stamp:  # leaving the mark behind: keep its read
            self.held_stamp, self.held = mark.stamp, self.slot_seconds(mark.t)
        if self.clock < self.paused_until:  # not allocated to rollout: no progress, no accounting
            self.clock = min(t, self.paused_until)
            if t <= self.clock:
                return
        span = t - self.clock
        self.alloc_s += span
        if not self.n:
            self.idle_s += span
            if self.idle_spans and self.idle_spans[-1][1] == self.clock:
                self.idle_spans[-1] = (self.idle_spans[-1][0], t)
            else:
                self.idle_spans.append((self.clock, t))
        self.busy_slot_s += min(self.n, self.slots) * span
        kv0 = self.live_kv()
        if self.clock < self.prefill_until:
            stall = min(t, self.prefill_until) - self.clock
            self.kv_token_s += kv0 * stall
            self.clock += stall
        dt = t - self.clock
        if self.n and dt > 0:
            if target is None:
                c0, c1 = self.step_and_growth(kv0)
                step = 2 * dt / (c0 + math.sqrt(c0 * c0 + 2 * c1 * dt))  # the stable root of the quadratic
            else:
                step = target - self.progress
            self.progress += step
            self.generated += self.n * step
            if self.decode_spans is not None:
                self.decode_spans.append((self.clock, t))
            self.kv_token_s += (kv0 + self.n * step / 2) * dt
        self.clock = t

    def slot_seconds(self, t: float) -> tuple[float, float]:
        """(busy, allocated) slot-seconds up to t (not before the clock), as advance_to(t) would count them, without
        running to t: the batch does not change between events."""
        span = t - (self.clock if self.clock >= self.paused_until else self.paused_until)
        if span < 0.0:
            span = 0.0
        return (self.busy_slot_s + (self.n if self.n < self.slots else self.slots) * span,
                self.slots * (self.alloc_s + span))

    def step_and_growth(self, kv: float) -> tuple[float, float]:
        """A decode step's time now, over `kv` live tokens, and its growth a step; a padded engine reads the
        longest running sequence's keys instead (rlsys/costs.py EngineCost.step_s)."""
        longest = 0.0
        if self.cost.max_len:
            longest = max((r.prompt_tokens + r.done + self.progress - r.base for _, k, r in self.running
                           if self._valid(k, r)), default=0.0)
        return self.cost.step_s(self.n, kv, longest), self.cost.growth_s(self.n)

    def next_event(self) -> Optional[tuple[float, float]]:
        """(time, progress) of the next finish or KV-full moment, if anything runs."""
        if not self.n:
            return None
        while self.running and not self._valid(*self.running[0][1:]):
            heapq.heappop(self.running)
        kv = self.live_kv()
        step = max(0.0, min(self.running[0][0] - self.progress, (self.cost.kv_capacity - kv) / self.n))
        c0, c1 = self.step_and_growth(kv)
        start = max(self.clock, self.paused_until, self.prefill_until)
        return start + c0 * step + 0.5 * c1 * step * step, self.progress + step

    def pause(self, now: float, until: float) -> None:
        """Hand the GPUs to the trainer or to weight sync; pending prefill resumes afterwards."""
        self.advance_to(now)
        left = max(0.0, self.prefill_until - now)
        self.paused_until = max(self.paused_until, until)
        self.prefill_until = self.paused_until + left if left else self.prefill_until
        self.epoch += 1

    def mark_version(self, version: int) -> None:
        self.mark_at.append(self.progress)
        self.mark_versions.append(version)

    # --- requests ----------------------------------------------------------------------------
    def enqueue(self, req: SimRequest) -> None:
        req.engine, req.state = self, QUEUED
        self.queue.append(req)
        self.queued += 1
        self.epoch += 1

    def abort(self, req: SimRequest, now: float) -> None:
        if req.state == QUEUED:
            self.queued -= 1
        else:
            self._remove(req)
        req.state, req.end_time = ABORTED, now
        self.epoch += 1

    def evict_all(self) -> list[SimRequest]:
        """Take every request off the engine (advanced to now), each keeping the tokens it has, to be resumed
        on another engine, which prefills them again as after a preemption."""
        moving = [req for key, req in self.admitted if self._valid(key, req)]
        for req in moving:
            self._remove(req)
            req.state = QUEUED
        moving += [req for req in self.queue if req.state == QUEUED]
        self.queue.clear()
        self.queued, self.kv_offset = 0, 0.0
        self.running, self.admitted = [], []  # all stale now, and a key may recur on the next engine
        self.epoch += 1
        return moving

    def settle(self, now: float) -> list[SimRequest]:
        """Finish what has finished, preempt while the KV cache is full, admit what fits."""
        finished = []
        while self.running and self.running[0][0] <= self.progress + EPS:
            _, key, req = heapq.heappop(self.running)
            if self._valid(key, req):
                self._remove(req, finished=True)
                req.state, req.end_time = DONE, now
                finished.append(req)
        while self.n and self.live_kv() >= self.cost.kv_capacity - EPS * self.n:
            self._preempt_newest()
        self._admit(now)
        self.epoch += 1
        return finished

    def _valid(self, key: int, req: SimRequest) -> bool:
        return req.state == RUNNING and req.key == key

    def _admit(self, now: float) -> None:
        prefill = 0.0
        while self.queue and self.n < self.max_seqs:
            req = self.queue[0]
            if req.state != QUEUED:  # aborted while waiting
                self.queue.popleft()
                continue
            need = req.prompt_tokens + req.done
            if self.n and self.live_kv() + need > self.admit_limit:
                break
            self.queue.popleft()
            self.queued -= 1
            self._keys += 1
            req.state, req.key, req.base = RUNNING, self._keys, self.progress
            self.kv_offset += need - self.progress
            self.n += 1
            heapq.heappush(self.running, (self.progress + req.target - req.done, req.key, req))
            self.admitted.append((req.key, req))
            if len(self.admitted) > 2 * self.n + 64:  # drop finished entries now and then, or they pile up
                self.admitted = [(k, r) for k, r in self.admitted if self._valid(k, r)]
            if req.start_time is None:
                req.start_time = now
            prefill += need * self.cost.prefill_s_per_token  # recompute after preemption, as vLLM does
        if prefill:
            self.prefill_until = max(self.prefill_until, self.paused_until, self.clock) + prefill

    def _preempt_newest(self) -> None:
        while True:
            key, req = self.admitted.pop()
            if self._valid(key, req):
                break
        self._remove(req)
        req.state = QUEUED
        self.queue.appendleft(req)
        self.queued += 1
        self.preemptions += 1
        self.recomputed_tokens += req.prompt_tokens + req.done  # charged as prefill when re-admitted

    def _remove(self, req: SimRequest, finished: bool = False) -> None:
        """Take a running request off the batch, crediting its tokens to the versions that made them."""
        self.n -= 1
        self.kv_offset -= req.prompt_tokens + req.done - req.base
        done = req.target if finished else min(req.target, req.done + self.progress - req.base)
        whole = round(done) if finished else int(done)
        self._credit(req, req.base, self.progress, whole - req.counted)
        req.done, req.counted = done, whole

    def _credit(self, req: SimRequest, start: float, end: float, tokens: int) -> None:
        if tokens <= 0:
            return
        i = bisect_right(self.mark_at, start) - 1
        # Weight updates that landed mid-generation split the tokens between versions.
        if i + 1 < len(self.mark_at) and self.mark_at[i + 1] < end:
            bounds = [start] + [d for d in self.mark_at[i + 1:] if d < end] + [end]
            total, given = end - start, 0
            for j in range(len(bounds) - 1):
                share = tokens - given if j == len(bounds) - 2 else round(tokens * (bounds[j + 1] - bounds[j]) / total)
                self._add_run(req, self.mark_versions[i + j], share)
                given += share
        else:
            self._add_run(req, self.mark_versions[i], tokens)

    @staticmethod
    def _add_run(req: SimRequest, version: int, tokens: int) -> None:
        if tokens <= 0:
            return
        if req.versions and req.versions[-1][0] == version:
            req.versions[-1] = (version, req.versions[-1][1] + tokens)
        else:
            req.versions.append((version, tokens))


def slot_seconds_at(engines, t: float, busy: float = 0.0, allocated: float = 0.0) -> tuple[float, float]:
    """(busy, allocated) slot-seconds of `engines` up to t, added to `busy` and `allocated`, as advance_to(t)
    would count them, without running them to t."""
    for e in engines:
        b, a = e.slot_seconds(t)
        busy += b
        allocated += a
    return busy, allocated


class SlotMark:
    """A moment whose slot-seconds may be asked for later: the last sample's finish, where a rollout window closes if
    no other sample finishes before the Train. Read at every finish, they would cost a loop over the engines each
    time; instead each engine keeps its own read at the mark when it first runs past it (SimEngine.advance_to), and
    `read` takes the rest as they stand: nothing changes an engine's count up to the mark but running past it."""
    __slots__ = ("t", "stamp", "engines", "busy", "allocated")

    def __init__(self):
        self.t, self.stamp, self.engines, self.busy, self.allocated = math.inf, 0, [], 0.0, 0.0

    def set(self, t: float, engines: list, busy: float = 0.0, allocated: float = 0.0) -> None:
        """Mark t over `engines` (each must carry this mark), their counts added to `busy` and `allocated`."""
        self.t, self.engines, self.busy, self.allocated = t, engines, busy, allocated
        self.stamp += 1

    def read(self) -> tuple[float, float]:
        """slot_seconds_at(engines, t, busy, allocated) as it stood at the mark."""
        busy, allocated = self.busy, self.allocated
        for e in self.engines:
            b, a = e.held if e.held_stamp == self.stamp else e.slot_seconds(self.t)
            busy += b
            allocated += a
        return busy, allocated


def replica_idle_gpu_s(engines: list[SimEngine], since: float, until: float, replica_gpus: int) -> float:
    """GPU-seconds in [since, until] that idle engines could lend a trainer whose replica needs
    `replica_gpus` GPUs: at each moment the idle GPUs, rounded down to whole replicas."""
    return replica_idle_by_interval(engines, [since, until], replica_gpus)[0]


def replica_idle_by_interval(engines: list[SimEngine], bounds: list[float], replica_gpus: int) -> list[float]:
    """replica_idle_gpu_s over each interval between consecutive `bounds` (non-decreasing times)."""
    since, until = bounds[0], bounds[-1]
    edges = []
    for engine in engines:
        for start, end in engine.idle_spans:
            start, end = max(start, since), min(end, until)
            if end > start:
                edges += [(start, engine.gpus), (end, -engine.gpus)]
    edges.sort()
    out = [0.0] * (len(bounds) - 1)
    idle, last, i = 0, since, 0
    for t, change in edges + [(until, 0)]:
        lent = idle // replica_gpus * replica_gpus
        while i < len(out) and bounds[i + 1] <= t:  # close the intervals that end by t
            out[i] += lent * (bounds[i + 1] - last)
            last, i = bounds[i + 1], i + 1
        if i < len(out):
            out[i] += lent * (t - last)
        idle, last = idle + change, t
    return out
