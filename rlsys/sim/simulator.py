"""The discrete-event loop: a control/ scheduler driven against simulated engines, rewards and a trainer.

The scheduler is built exactly as the live controller builds it (`rlsys.control.build_scheduler`; only
control.tail_eta_r, a validation-only rule, builds another: rlsys/sim/first_r.py) and is driven the same way
(rlsys/train.py): start, on_sample for each scored sample, on_abort for each aborted request's partial output,
on_trained after each step, then start again (not after the last). Only the clock, the engines, the reward pool
and the trainer are simulated.
"""
from __future__ import annotations

import gc
import heapq
import math
import time
from collections import Counter, defaultdict, deque
from typing import Optional

from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.events import Aborted, Scored
from rlsys.control.elastic_tp import ElasticTP, plan_tp
from rlsys.control.metrics import idle_share, percentile, straggler_rate
from rlsys.costs import (GPUS, TRAIN_FLOPS, engine_bytes, switch_seconds, sync_seconds, train_gpu_seconds,
                         trainer_states)
from rlsys.data.cursor import PromptCursor
from rlsys.placement import lent_engines
from rlsys.sim.config import SchedulerRun, SimConfig
from rlsys.runs import Runs, run_lengths
from rlsys.sim.first_r import build
from rlsys.sim.engine import (ABORTED, DONE, QUEUED, RUNNING, SimEngine, SimRequest, SlotMark,
                              replica_idle_by_interval, slot_seconds_at)
from rlsys.sim.workload import SampleDraw, Workload
from rlsys.step_stats import rollout_opens
from rlsys.types import Completion, ScoredSample

ENGINE, SAMPLE, ABORTED_OUT, SYNC, TRAINED = "engine", "sample", "aborted", "sync", "trained"


class SimulationError(AssertionError):
    pass


def makespan(durations: list[float], workers: int | None) -> float:
    """Wall time for a pool of `workers` (None: unbounded) to run these jobs, longest first."""
    if not durations:
        return 0.0
    if workers is None or workers >= len(durations):
        return max(durations)
    free = [0.0] * workers
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def long_round_bound(cfg: SimConfig, run: SchedulerRun):
    """The run's control section; unless set, tail's long round holds what the engines' KV caches can:
    a sample's KV grows from its prompt to its length, so over its life it holds about prompt + length / 2,
    and with lengths up to the cap, engines x KV / (prompt + cap / 2) samples fit without pre-emption."""
    control = cfg.control_for(run)
    if control.tail.long_round_samples is not None:
        return control
    cluster = cfg.cluster_for(run)
    engine = cfg.engine_cost(cluster, cfg.trainer_for(run))
    held = cluster.rollout_gpus // cluster.tp * engine.kv_capacity * (1 - cfg.engine.kv_watermark)
    per_sample = cfg.workload.prompt_tokens + cfg.workload.max_tokens / 2
    tail = control.tail.model_copy(update={"long_round_samples": max(1, int(held // per_sample))})
    return control.model_copy(update={"tail": tail})


def load_heap(engines) -> list[tuple[int, int]]:
    """(requests held, index) of each engine, least loaded first: for `least_loaded`."""
    loads = [(e.load, e.index) for e in engines]
    heapq.heapify(loads)
    return loads


def least_loaded(loads: list[tuple[int, int]], requests: int = 1) -> int:
    """The index of the least-loaded engine in `loads`, counted as holding `requests` more."""
    load, index = loads[0]
    heapq.heapreplace(loads, (load + requests, index))
    return index


def mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class Simulation:
    def __init__(self, cfg: SimConfig, run: SchedulerRun, workload: Optional[Workload] = None):
        self.cfg, self.run_spec = cfg, run
        cluster, control = cfg.cluster_for(run), long_round_bound(cfg, run)
        self.kappa = control.straggler_kappa
        self.per_prompt = cfg.engine.dispatch == "prompt"
        self.shape, self.gpu = cfg.shape(), GPUS[cluster.gpu]
        self.colocated = cluster.trainer_gpus is None
        self.trainer_gpus = cluster.trainer_gpus or cluster.gpus
        self.reward, self.trainer = cfg.reward_for(run), cfg.trainer_for(run)
        self.sync_s = sync_seconds(self.shape, cfg.weight_sync.bandwidth_gbps, cfg.weight_sync.latency_s)
        self.cluster, self.control = cluster, control
        self.workload = workload or Workload(cfg.workload, cfg.reward, cfg.seed)  # shareable: it only caches
        # Cut samples by prompt uid and ordinal, until resumed or replaced (`_submit`); a prompt drawn again
        # starts afresh. `ordinal`: each request's sample, the identity a cut one's tokens carry.
        self.cut: defaultdict[str, dict[int, SampleDraw]] = defaultdict(dict)
        self.ordinal: dict[str, int] = {}
        cursor = Visits(self.workload.prompts(), cfg.seed, self.cut)
        self.scheduler = build(control, cursor)

        self.now, self.version, self.trained = 0.0, 0, 0
        self.events: list = []
        self._seq = 0
        self.requests: dict[str, SimRequest] = {}  # not yet delivered to the scheduler
        self.known: set[str] = set()
        self.samples_drawn: Counter[str] = Counter()  # per prompt uid, to key the workload's draws
        # Reward pools, "" the shared one: a kind with its own workers is scored on its own pool, in parallel.
        self.pool_sizes = {"": self.reward.workers, **{n: k.workers for n, k in self.reward.kinds.items() if k.workers}}
        self.reward_free = {pool: [0.0] * n for pool, n in self.pool_sizes.items() if n}  # bounded pools only
        self.reward_pending: defaultdict[str, list[float]] = defaultdict(list)  # without overlap: the step's latencies
        self.reward_s: list[float] = []
        self.stream = Stream()
        self.trainer_free_at = self.trainer_idle_s = 0.0  # separate trainer GPUs: last finish, idle total
        self.train_queue: deque[tuple[list, float]] = deque()  # (groups, trainer seconds) waiting
        self.training: Optional[list] = None  # the groups being trained
        self.counts: Counter[str] = Counter()
        self.step_start = self.handover = self.last_finish = 0.0  # rollout window, last Train, last sample
        # (busy, allocated) slot-seconds: inside the rollout windows, at the window's opening, at the last Train
        self.in_windows, self.opened, self.at_handover = (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)
        self.last_finish_mark = SlotMark()  # their count at the last sample's finish, read at the Train
        self.rollout_s: list[float] = []
        self.train_s: list[float] = []
        self.step_ends: list[float] = []
        self.group_lengths: list[list[int]] = []
        self.trained_tokens = self.wasted_tokens = self.truncated = 0
        self.controller_s = 0.0
        self.controller_calls = 0
        self.tp = cluster.tp
        self.engines = self._build_engines(cluster.tp)
        self.retired: list[SimEngine] = []  # engines of earlier TP sizes, kept for their figures
        self.retired_slot_s = (0.0, 0.0)  # their (busy, allocated) slot-seconds, fixed once retired
        self.elastic = (ElasticTP(control.elastic_tp, cluster.tp, cfg.tp_sizes(cluster, control.elastic_tp))
                        if control.elastic_tp.enabled else None)
        self.next_tp = cluster.tp
        self.round_lengths: dict[bool, list[int]] = {}  # long round or not: the last such round's trained lengths
        self.long_steps: list[int] = []  # indices of the steps that were tail's long rounds
        self.partial: dict[str, float] = {}  # prompt uid: the most tokens an aborted sample of it had
        self.tp_per_step: list[int] = []
        self.preemptions_by_step: list[int] = []
        self._round_start = (0, 0)  # (preemptions, submitted requests) when the step's round began
        self.streamed_groups = 0  # groups the step has streamed so far
        self.lent: set[int] = set()  # engines scaled down for the trainer until the step's Train
        # colocated streamed batches that take every GPU (trainer.contend): this step's (begin, end)
        self.contending = self.colocated and self.trainer.contend and self.trainer.scale_down_at is None
        self.sleeps = self.colocated and cluster.colocation == "sleep"  # each switch of a GPU pays (switch_s)
        self.switches = 0  # switches of every GPU at once between the engines and the trainer
        self.stream_spans: list[tuple[float, float]] = []
        self.trainer_spans: list[tuple[float, float]] = []  # colocated: when the trainer held every GPU

    def _build_engines(self, tp: int) -> list[SimEngine]:
        cost = self.cfg.engine_cost(self.cluster.model_copy(update={"tp": tp}), self.trainer)
        count = self.cluster.rollout_gpus // tp
        # Bubble capacity: the concurrency a nominal step can fill, the same for every scheduler (a replay sets the
        # live run's instead: engine.bubble_slots).
        slots = self.cfg.engine.bubble_slots or min(
            self.cfg.engine.max_seqs, math.ceil(self.control.prompts_per_step * self.control.group_size / count))
        engines = [SimEngine(i, cost, self.cfg.engine.max_seqs, self.cfg.engine.kv_watermark, slots)
                   for i in range(count)]
        for engine in engines:  # born now, serving the current weights
            engine.clock, engine.mark_versions, engine.gpus = self.now, [self.version], tp
            engine.mark = self.last_finish_mark
        return engines

    def _all_engines(self) -> list[SimEngine]:
        return self.engines + self.retired

    def _slot_seconds(self) -> tuple[float, float]:
        """Busy and allocated slot-seconds of every engine up to now: the live ones read to now, not run to it
        (no engine's batch changes between events), the retired ones as they were left."""
        return slot_seconds_at(self.engines, self.now, *self.retired_slot_s)

    # --- the loop ------------------------------------------------------------------------
    def run(self, trace: Optional[list] = None) -> dict:
        # Millions of short-lived, acyclic records: generational GC passes over the long-lived ones
        # would cost ~40% of the run and reclaim nothing that reference counting does not.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(trace)
        finally:
            if collecting:
                gc.enable()

    def _run(self, trace: Optional[list]) -> dict:
        wall = time.perf_counter()
        self._act(self._call(self.scheduler.start, 0.0))
        events, pop = self.events, heapq.heappop
        while self.trained < self.cfg.steps:
            if not events:
                raise SimulationError(f"{self.run_spec.label}: nothing left to simulate after "
                                      f"{self.trained} steps (the scheduler stopped submitting work)")
            t, _, kind, obj, extra = pop(events)
            if kind == ENGINE and extra[0] != obj.epoch:
                continue  # superseded by a later change to that engine
            if t < self.now - 1e-9:
                raise SimulationError(f"time went backwards: {kind} event at {t} after {self.now}")
            self.now = max(self.now, t)
            if trace is not None:
                trace.append((self.now, kind))
            if kind == ENGINE:
                obj.advance_to(self.now, extra[1])
                self._refresh(obj)
            elif kind == SAMPLE:
                self._deliver(obj)
            elif kind == ABORTED_OUT:
                self._act(self._call(self.scheduler.handle, Aborted(obj), self.now))
            elif kind == SYNC:
                self._weight_sync()
            else:
                self._trained()
        self.check()
        return self._metrics(time.perf_counter() - wall)

    def _push(self, t: float, kind: str, obj=None, extra=None) -> None:
        self._seq += 1  # ties break in insertion order, so runs are deterministic
        heapq.heappush(self.events, (t, self._seq, kind, obj, extra))

    def _call(self, fn, *args) -> list:
        start = time.perf_counter()
        actions = fn(*args)
        self.controller_s += time.perf_counter() - start
        self.controller_calls += 1
        return actions

    def _refresh(self, engine: SimEngine) -> None:
        for req in engine.settle(self.now):
            self._generated(req)
        nxt = engine.next_event()
        if nxt is not None:
            self._push(nxt[0], ENGINE, engine, (engine.epoch, nxt[1]))

    def _touch(self, engine: SimEngine, touched: dict) -> None:
        if engine.index not in touched:
            engine.advance_to(self.now)
            touched[engine.index] = engine

    # --- actions ----------------------------------------------------------------------------
    def _act(self, actions: list) -> None:
        if not actions:
            return
        touched: dict[int, SimEngine] = {}
        loads = None
        for action in actions:
            if isinstance(action, Submit):
                if loads is None:
                    loads = load_heap(e for e in self.engines if e.index not in self.lent)
                self._submit(action, loads, touched)
            elif isinstance(action, Abort):
                loads = None  # aborts free slots: recount before the next dispatch
                self._abort(action, touched)
            elif isinstance(action, Train):
                self._train(action, touched)
            elif isinstance(action, Accumulate):
                # scale_down_at lends GPUs in long rounds only; a short round trains after it, as live (rlsys/train.py)
                if self.trainer.streamed and (self.trainer.scale_down_at is None or action.long_round):
                    self.stream.add(self._tokens(action.groups), self.now, self._trainer_idle_s())
                    if self.contending:
                        self._contend(self._tokens(action.groups), touched)
                    self.streamed_groups += len(action.groups)
                    at = self.trainer.scale_down_at
                    if at is not None and not self.lent and self.streamed_groups >= at * action.train_groups:
                        self._scale_down(touched)
                        loads = None
            else:
                raise SimulationError(f"unknown action {action!r}")
        for engine in touched.values():
            self._refresh(engine)

    def _submit(self, action: Submit, loads: list, touched: dict) -> None:
        prompt = action.prompt
        traits = self.workload.traits(prompt)
        first = self.samples_drawn[prompt.uid]
        self.samples_drawn[prompt.uid] += len(action.request_ids)
        # A resumed request goes on with the sample its tokens name (`_abort`). The fresh ones replace the prompt's
        # other cut samples, lowest ordinal first: a replaced runaway (cut at the cap) runs away again.
        cut = self.cut[prompt.uid]
        going_on = {rid: r.resume_ids[0] for rid, r in action.resume.items() if len(r.resume_ids)}
        fresh = [j for j, rid in enumerate(action.request_ids) if rid not in going_on]
        replaced = [cut.pop(o) for o in sorted(set(cut) - set(going_on.values()))[:len(fresh)]]
        runaway_at = fresh[:sum(d.truncated for d in replaced)]
        draws = self.workload.samples(prompt, first, len(action.request_ids), runaway_at)
        for j, rid in enumerate(action.request_ids):
            if rid in self.known:
                raise SimulationError(f"request id {rid!r} submitted twice")
            self.known.add(rid)
            draw, self.ordinal[rid] = draws[j], first + j
            resume = action.resume.get(rid)
            done = len(resume.resume_ids) if resume else 0
            if done:
                self.ordinal[rid] = going_on[rid]
                # its draw gone only if the prompt was drawn again and a fresh sample replaced it: then a fresh one
                draw = self.workload.resumed(prompt, first + j, done, cut.pop(going_on[rid], draw))
            req = SimRequest(rid, prompt, traits.prompt_tokens, draw, self.now, done)
            if resume:
                req.versions = run_lengths(resume.resume_versions)
            if j == 0 or not self.per_prompt:  # least-loaded dispatch, as OpenRLHF does
                index = least_loaded(loads, len(action.request_ids) if self.per_prompt else 1)
            engine = self.engines[index]
            self._touch(engine, touched)
            engine.enqueue(req)
            self.requests[rid] = req
            self.counts["submitted"] += 1

    def _contend(self, tokens: int, touched: dict) -> None:
        """A streamed batch on every GPU, after the ones before it: the engines wait for it, and for the switches
        to it and back, as live (rlsys/emulate.py GPUTimeline); one queued behind the batch before, whose switch
        back had not begun, switches no more. `stream_spans` hold the batches' training alone."""
        last = max([end for _, end in self.stream_spans], default=-math.inf)
        chained = self.now < last + self.switch_s()
        begin = max(self.now, last) if chained else self.now + self.switch_s()
        end = begin + self._streamed_share() * self._gpu_s(tokens) / self.trainer_gpus
        self.stream_spans.append((begin, end))
        self.switches += 1 if chained else 2
        for engine in self.engines:
            self._touch(engine, touched)
            engine.pause(self.now, end + self.switch_s())

    def switch_s(self) -> float:
        """A switch of the colocated GPUs between the engines and the trainer, either way (costs.switch_seconds):
        asleep, the engines' weights and the trainer's states cross the host link; resident or separate, 0."""
        if not self.sleeps:
            return 0.0
        states = trainer_states(self.shape, self.trainer_gpus, self.trainer.zero_stage)
        return switch_seconds(self.gpu, engine_bytes(self.shape, self.tp), states)

    def _streamed_share(self) -> float:
        """The share of a group's trainer FLOPs that stream: its forward and backward."""
        return min(1.0, TRAIN_FLOPS / self.trainer.flops_per_param_token)

    def _scale_down(self, touched: dict) -> None:
        """Half the engines hand their requests to the other half (least loaded first) and, idle, lend their
        GPUs to the streamed trainer until the step's Train."""
        moving = []
        for engine in (self.engines[i] for i in lent_engines(len(self.engines))):
            self._touch(engine, touched)
            moving += engine.evict_all()
            self.lent.add(engine.index)
        loads = load_heap(e for e in self.engines if e.index not in self.lent)
        for req in moving:
            engine = self.engines[least_loaded(loads)]
            self._touch(engine, touched)
            engine.enqueue(req)
        self.counts["migrated"] += len(moving)

    def _abort(self, action: Abort, touched: dict) -> None:
        for rid in action.request_ids:
            req = self.requests.get(rid)
            if req is None or req.state in (DONE, ABORTED):
                if rid not in self.known:
                    raise SimulationError(f"abort of request {rid!r}, which was never submitted")
                self.counts["late_aborts"] += 1  # already generated: the reward still arrives
                continue
            self._touch(req.engine, touched)
            req.engine.abort(req, self.now)
            self.wasted_tokens += int(req.done)
            self.partial[req.prompt.uid] = max(self.partial.get(req.prompt.uid, 0.0), req.done)
            self.counts["aborted"] += 1
            del self.requests[rid]
            ordinal = self.ordinal.pop(rid)
            self.cut[req.prompt.uid][ordinal] = SampleDraw(req.target, req.truncated, req.reward, req.reward_latency)
            # As from a live engine: the partial output comes back, after the actions at hand; its tokens name
            # the sample, so that a resumed request goes on with it.
            self._push(self.now, ABORTED_OUT, self._completion(req, int(req.done), "abort", ordinal))

    @staticmethod
    def _tokens(groups: list) -> int:
        return sum(sum(g.lengths) + sum(len(s.completion.prompt_ids) for s in g.samples) for g in groups)

    def _gpu_s(self, tokens: float) -> float:
        t = self.trainer
        return train_gpu_seconds(self.shape, self.gpu, tokens, t.mfu_on(self.trainer_gpus), t.flops_per_param_token)

    def _trainer_idle_s(self) -> float:
        """Seconds the separate trainer has had nothing to train, up to now."""
        free = self.now - self.trainer_free_at if self.training is None and not self.train_queue else 0.0
        return self.trainer_idle_s + free

    def _streamed_gpu_s(self) -> float:
        """Trainer GPU-seconds the step's streamed groups got done during the rollout. Only a group's forward
        and backward stream (we assume its reference and old-log-prob forwards run after the round over the
        whole batch, as veRL computes them; the optimizer updates, one per mini-batch, cost no modelled time),
        each on GPUs idle after the group came, oldest first: when colocated, rollout GPUs with nothing to
        decode (under trainer.scale_down_at, only the engines scaled down), in whole trainer replicas
        (trainer.replica_gpus); else the trainer's own GPUs while it had
        nothing to train."""
        arrivals = self.stream.take()
        if self.contending:  # what of the batches' time on every GPU has passed by now
            spans = [(begin, min(end, self.now)) for begin, end in self.stream_spans if begin < self.now]
            self.trainer_spans += spans
            self.stream_spans = []
            return sum(end - begin for begin, end in spans) * self.trainer_gpus
        if not arrivals:
            return 0.0
        bounds = [t for t, _, _ in arrivals] + [self.now]
        if self.colocated:
            lenders = self._all_engines()
            if self.trainer.scale_down_at is not None:  # RollPacker trains only on the engines it scaled down
                lenders = [e for e in self.engines if e.index in self.lent]
            room = replica_idle_by_interval(lenders, bounds, self.trainer.replica_gpus)
            # each lending GPU switches to the trainer once before it trains (its switch back is the Train's)
            owed = self.switch_s() * sum(e.gpus for e in lenders) if arrivals else 0.0
            for i, free in enumerate(room):
                room[i], owed = max(0.0, free - owed), max(0.0, owed - free)
        else:
            idle = [i for _, _, i in arrivals] + [self._trainer_idle_s()]
            room = [self.trainer_gpus * (b - a) for a, b in zip(idle, idle[1:])]
        backlog = done = 0.0
        for (_, tokens, _), free in zip(arrivals, room):
            backlog += self._streamed_share() * self._gpu_s(tokens)
            used = min(backlog, free)
            backlog, done = backlog - used, done + used
        return done

    def _train(self, action: Train, touched: dict) -> None:
        self.round_lengths[self._long_round()] = [n for g in action.groups for n in g.lengths]
        if self._long_round():
            self.long_steps.append(len(self.rollout_s))
        for group in action.groups:
            lengths = group.lengths
            self.group_lengths.append(lengths)
            self.trained_tokens += sum(lengths)
            self.truncated += sum(s.completion.finish_reason == "length" for s in group.samples)
        # The window closes at the last sample generated before the handover, as the live run's does: time after
        # it (the batch ready, waiting for the trainer or the rewards) is neither rollout nor bubble.
        generating = self.last_finish > self.step_start
        self.rollout_s.append(self.last_finish - self.step_start if generating else 0.0)
        self.handover = self.now
        for engine in self.engines:
            engine.advance_to(self.now)
        self.at_handover = self._slot_seconds()
        closed = self.last_finish_mark.read() if generating else self.opened
        self.in_windows = tuple(w + now - then for w, now, then in zip(self.in_windows, closed, self.opened))
        # Without overlap the step's rewards are scored now, on the reward pool, before its training.
        reward_s = 0.0 if self.reward.overlap else max(
            (makespan(waiting, self.pool_sizes[pool]) for pool, waiting in self.reward_pending.items()), default=0.0)
        self.reward_pending.clear()
        self.reward_s.append(reward_s)
        if self.trainer.streamed:
            for engine in self.engines:  # bring their idle time up to now
                engine.advance_to(self.now)
        streamed = self._streamed_gpu_s()
        self.streamed_groups, self.lent = 0, set()
        for engine in self._all_engines():  # idle spans before now serve no later step
            engine.idle_spans = engine.idle_spans[-1:]
        work = max(0.0, self._gpu_s(self._tokens(action.groups)) - streamed)
        self.train_s.append(work / self.trainer_gpus + self.trainer.overhead_s)
        self.train_queue.append((action.groups, reward_s + self.train_s[-1]))
        if self.training is None:
            self._start_training(touched)

    def _start_training(self, touched: dict) -> None:
        self.trainer_idle_s += max(0.0, self.now - self.trainer_free_at)
        self.training, seconds = self.train_queue.popleft()
        if self.colocated:  # the switch to the trainer, training, the switch back and the weight reload hold every GPU
            seconds += 2 * self.switch_s()
            self.switches += 2
            for engine in self.engines:
                self._touch(engine, touched)
                engine.pause(self.now, self.now + seconds + self.sync_s)
            self.trainer_spans.append((self.now, self.now + seconds + self.sync_s))
            self._push(self.now + seconds + self.sync_s, TRAINED)
        else:
            self._push(self.now + seconds, SYNC)

    # --- events -----------------------------------------------------------------------------
    def _generated(self, req: SimRequest) -> None:
        self.counts["finished"] += 1
        self.last_finish = self.now
        self.last_finish_mark.set(self.now, self.engines, *self.retired_slot_s)  # where a rollout window may close
        if not self.reward.overlap:  # scored with its step's batch; the scheduler sees it now
            self.reward_pending[self._reward_pool(req)].append(req.reward_latency)
            self._push(self.now, SAMPLE, req)
            return
        start = self.now
        free = self.reward_free.get(self._reward_pool(req))
        if free is not None:  # a bounded reward pool: wait for the first free worker
            start = max(start, heapq.heappop(free))
            heapq.heappush(free, start + req.reward_latency)
        self._push(start + req.reward_latency, SAMPLE, req)

    def _reward_pool(self, req: SimRequest) -> str:
        kind = self.workload.traits(req.prompt).reward_kind
        return kind if kind in self.pool_sizes else ""

    def _deliver(self, req: SimRequest) -> None:
        self.requests.pop(req.rid, None)
        self.ordinal.pop(req.rid, None)
        completion = self._completion(req, req.target, "length" if req.truncated else "stop")
        self._act(self._call(self.scheduler.handle, Scored(ScoredSample(completion, req.reward)), self.now))

    @staticmethod
    def _completion(req: SimRequest, tokens: int, reason: str, ordinal: Optional[int] = None) -> Completion:
        """Token lists stand in as run-length sequences: only lengths and versions matter here, and a cut
        sample's ordinal, its every token."""
        start = req.start_time if req.start_time is not None else req.end_time
        ids = Runs.repeat(0, tokens) if ordinal is None else Runs([(ordinal, tokens)])  # not cached: one each
        return Completion(
            req.rid, req.prompt.uid, Runs.repeat(0, req.prompt_tokens), ids,
            Runs.repeat(0.0, tokens), Runs(req.versions), reason, worker=req.engine.index,
            submit_time=req.submit_time, start_time=start, end_time=req.end_time)

    def _weight_sync(self) -> None:
        for engine in self.engines:  # engines stop generating while new weights load
            engine.pause(self.now, self.now + self.sync_s)
            self._refresh(engine)
        self._push(self.now + self.sync_s, TRAINED)

    def _trained(self) -> None:
        self.trainer_free_at = self.now
        self.version += 1
        self.trained += 1
        self.step_ends.append(self.now)
        for engine in self.engines:
            engine.advance_to(self.now)
            engine.mark_version(self.version)
        groups, self.training = self.training, None
        self._call(self.scheduler.on_trained, self.version, groups)
        self._end_round()
        touched: dict[int, SimEngine] = {}
        if self.train_queue:
            self._start_training(touched)
        for engine in touched.values():
            self._refresh(engine)
        self.step_start = rollout_opens(self.now, self.handover, self.last_finish)  # as the live run's
        self.opened = self.at_handover if self.step_start == self.handover else self._slot_seconds()
        if self.trained < self.cfg.steps:  # after the last step nothing more is asked of the scheduler
            self._act(self._call(self.scheduler.start, self.now))

    def _end_round(self) -> None:
        """Per-step KV figures; under elastic TP, the planner's choice for the next round. Engines are
        rebuilt only while idle (nothing queued or running, trainer done); until then the change waits."""
        preempted, submitted = sum(e.preemptions for e in self._all_engines()), self.counts["submitted"]
        round_preempted = preempted - self._round_start[0]
        self.preemptions_by_step.append(round_preempted)
        self.tp_per_step.append(self.tp)
        if self.elastic is not None and self.control.elastic_tp.rule == "preemptions":
            self.next_tp = self.elastic.observe(round_preempted, submitted - self._round_start[1])
        elif self.elastic is not None:
            self.next_tp = self._plan_next_round()
        self._round_start = (preempted, submitted)
        idle = self.training is None and not self.train_queue and not any(e.load for e in self.engines)
        if self.next_tp != self.tp and idle:
            for engine in self.engines:
                engine.advance_to(self.now)
            self.retired += self.engines
            busy, allocated = self.retired_slot_s
            self.retired_slot_s = (busy + sum(e.busy_slot_s for e in self.engines),
                                   allocated + sum(e.slots * e.alloc_s for e in self.engines))
            self.engines, self.tp = self._build_engines(self.next_tp), self.next_tp
            for engine in self.engines:  # the re-sharded engines load the weights, as after a weight sync
                engine.pause(self.now, self.now + self.sync_s)

    def _long_round(self) -> bool:
        return bool(getattr(self.scheduler, "long_round", False))

    def _plan_next_round(self) -> int:
        """The planner's TP for the round about to start, from its type and the lengths it can expect: those of
        the last round of that type; before tail's first long round, twice what its queued prompts' aborted
        samples had reached (cut at a random point, a sample is on average half done)."""
        queue = [d.prompt for d in getattr(self.scheduler, "queue", ())]  # tail's deferred prompts
        due = getattr(self.scheduler, "long_round_due", None)
        long = bool(due and due(self.control.prompts_per_step))
        lengths = self.round_lengths.get(long)
        if lengths:
            mean_tokens, longest = mean(lengths), max(lengths)
        elif long:
            mean_tokens = min(self.cfg.workload.max_tokens, 2 * mean([self.partial.get(p.uid, 0.0) for p in queue]))
            longest = self.cfg.workload.max_tokens
        else:
            return self.tp
        # A long round keeps at most the configured TP, the direction RollPacker measured (Qwen3-8B/32k on 8 H800:
        # long rounds 1,284 s at TP2 against 1,172 s at TP1, short rounds 768 against 1,029): the cost model misses
        # that loss (the TP2:TP1 rows of calibration_tp.py), so by its estimate alone long rounds would take TP8.
        capped = long and self.control.elastic_tp.long_rounds_at_base
        sizes = [tp for tp in self.elastic.allowed if not capped or tp <= self.cluster.tp]
        costs = {tp: self.cfg.engine_cost(self.cluster.model_copy(update={"tp": tp}), self.trainer)
                 for tp in sizes}
        return plan_tp(costs, self.cluster.rollout_gpus, samples=self.control.prompts_per_step * self.control.group_size,
                       mean_tokens=mean_tokens, longest=longest, prompt_tokens=self.cfg.workload.prompt_tokens,
                       max_seqs=self.cfg.engine.max_seqs)

    # --- checks and figures ----------------------------------------------------------------------
    def check(self) -> None:
        """Every request finished or was aborted exactly once, or is still in flight."""
        live = Counter(r.state for r in self.requests.values())
        in_flight = live[QUEUED] + live[RUNNING]
        c = self.counts
        if c["submitted"] != c["finished"] + c["aborted"] + in_flight:
            raise SimulationError(f"request accounting broken: submitted {c['submitted']} != finished "
                                  f"{c['finished']} + aborted {c['aborted']} + in flight {in_flight}")
        if sum(e.load for e in self.engines) != in_flight:
            raise SimulationError("engines hold a different number of requests than are in flight")
        self.scheduler.ledger.check(self.scheduler.in_flight_prompts())

    def _metrics(self, wall_s: float) -> dict:
        for engine in self.engines:
            engine.advance_to(self.now)
        engines = self._all_engines()
        sim_s = self.now
        alloc = sum(e.slots * e.alloc_s for e in engines)
        busy = sum(e.busy_slot_s for e in engines)
        kv_room = sum(e.cost.kv_capacity * e.alloc_s for e in engines)
        kv = sum(e.kv_token_s for e in engines) / kv_room if kv_room else 0.0
        lengths = [n for g in self.group_lengths for n in g]
        generated = sum(e.generated for e in engines)
        steps = self.trained
        return {
            "scheduler": self.run_spec.name,
            "steps": steps,
            "sim_time_s": sim_s,
            "step_time_s": sim_s / steps,
            "rollout_time_s": mean(self.rollout_s),
            "rollout_by_step_s": self.rollout_s,
            "train_time_s": mean(self.train_s),
            "reward_wait_s": mean(self.reward_s),
            "weight_sync_s": self.sync_s,
            "switch_s": self.switch_s(),  # colocated asleep: one switch of the GPUs between engines and trainer
            "switches_per_step": self.switches / steps,
            "bubble_ratio": idle_share(busy, alloc),
            # the live run's `rollout/bubble_ratio`: only inside the steps' rollout windows (engines idle while a
            # trainer of its own GPUs trains, or after the last Train, left out)
            "rollout_bubble_ratio": idle_share(*self.in_windows),
            "kv_utilization": kv,
            "straggler_rate": straggler_rate(self.group_lengths, self.kappa),
            "tokens_per_s": self.trained_tokens / sim_s,
            "generated_tokens_per_s": generated / sim_s,
            "wasted_token_share": self.wasted_tokens / generated if generated else 0.0,
            "truncated_share": self.truncated / len(lengths) if lengths else 0.0,
            "response_tokens": {"mean": mean(lengths), "p50": percentile(lengths, 50),
                                "p99": percentile(lengths, 99), "max": max(lengths, default=0)},
            "trained_prompts": len(self.group_lengths),
            "trained_samples": len(lengths),
            "preemptions_per_step": sum(e.preemptions for e in engines) / steps,
            "recomputed_tokens_per_step": sum(e.recomputed_tokens for e in engines) / steps,
            "preemptions_by_step": self.preemptions_by_step,
            "tp_per_step": self.tp_per_step,
            "requests": {k: self.counts[k] for k in ("submitted", "finished", "aborted", "late_aborts", "migrated")},
            "prompts": self.scheduler.metrics(),
            "step_ends_s": self.step_ends,
            "long_round_steps": self.long_steps,
            "wall": {"run_s": wall_s, "controller_s": self.controller_s,
                     "controller_calls": self.controller_calls,
                     "controller_share": self.controller_s / sim_s},
        }


class Visits(PromptCursor):
    """The run's cursor: a prompt it draws is a new visit, whose samples replace none cut in an earlier one."""

    def __init__(self, prompts: list, seed: int, cut: dict):
        super().__init__(prompts, seed)
        self.cut = cut

    def take(self, n: int) -> list:
        prompts = super().take(n)
        for prompt in prompts:
            self.cut.pop(prompt.uid, None)
        return prompts


class Stream:
    """Streamed training's ledger for one step: each streamed batch of groups as it came (time, tokens, and
    the separate trainer's idle total then)."""

    def __init__(self):
        self.arrivals: list[tuple[float, int, float]] = []

    def add(self, tokens: int, now: float, trainer_idle: float) -> None:
        self.arrivals.append((now, tokens, trainer_idle))

    def take(self) -> list[tuple[float, int, float]]:
        """Closes the step: its arrivals."""
        arrivals, self.arrivals = self.arrivals, []
        return arrivals
