"""The driver's handle on all rollout workers: dispatch, streaming completions, abort, weight sync.

Each worker always has exactly one `drain` call in flight; `refs()` hands those to the controller,
which waits on them together with other components' refs and passes the ready ones to `collect()`.
Requests go to the worker with the fewest outstanding requests (submitted, not yet collected).

A worker that dies (killed, OOM, node lost) is replaced under the same index: the new one loads the
last weights passed to `update_weights` or `load_weights`, sleeps if the others do, then gets the dead one's requests
again (same ids and seeds: a seeded request, as eval's, gives the same sample; an unseeded one, as
training's, the same on the built-in engine, which draws it from the run seed and its id, and a fresh
draw on vLLM); requests the caller aborted come back cut instead. Each prompt's samples thus
arrive exactly once. `rollout.max_restarts` deaths of a worker in a row, with no request finished in
between, stop the run. So does any death when the weights come by a transfer a new worker cannot join
(weights.transfer=broadcast or cuda_ipc: `restarts_refused`, see rlsys/weights/sync.py).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Callable

import ray
from ray import ObjectRef
from ray.exceptions import OwnerDiedError, RayActorError, RayTaskError

from rlsys.cluster import actor_id, death_reason
from rlsys.emulate import Emulation
from rlsys.logger import waiting
from rlsys.placement import ROLLOUT, lent_engines
from rlsys.rollout.engine import SLEEP_TAGS
from rlsys.rollout.registry import engine_entry
from rlsys.rollout.worker import RemoteRolloutWorker
from rlsys.types import Completion, Request, RunStopped
from rlsys.weights import WeightUpdate


def engine_options(cfg) -> dict:
    """Engine options from a run's Config: the KV cache sized to the longest prompt plus response, and the
    engine's own (its registry entry says which)."""
    r = cfg.rollout
    options = {"max_len": cfg.data.max_prompt_tokens + r.max_new_tokens, "dtype": r.engine_dtype, "seed": cfg.seed,
               "running_requests": cfg.weights.running_requests, **engine_entry(r.engine).options(r)}
    if cfg.emulate.on:  # the built-in engine only (Config refuses others)
        emulation = Emulation.of(cfg)  # one pacer per engine, on its modelled GPUs: _new_worker picks its own
        options["pacer"] = tuple(emulation.engine_pacer(i) for i in range(r.num_workers))
    return options


def worker_gpus(engine: str, engine_kwargs: dict) -> int:
    """The GPUs a rollout worker asks Ray for where no placement plan gives it a bundle."""
    return engine_entry(engine).gpus(engine_kwargs)


class RolloutManager:
    restarts_refused: str | None = None  # why a dead worker cannot be replaced, e.g. "weights.transfer=broadcast"

    @classmethod
    def from_config(cls, cfg, model_dir, placement=None) -> "RolloutManager":
        """The run's engines, as `cfg.rollout` and `cfg.cluster` describe them (in `placement`'s groups)."""
        return cls(str(model_dir), cfg.rollout.num_workers, cfg.rollout.slots, torch_threads=cfg.cluster.torch_threads,
                   engine_kwargs=engine_options(cfg), engine=cfg.rollout.engine, max_restarts=cfg.rollout.max_restarts,
                   placement=placement, handoff_s=cfg.rollout.handoff_s, tools=cfg.tools)

    def __init__(self, model_dir: str, num_workers: int, slots: int, torch_threads: int | None = None,
                 engine_kwargs: dict | None = None, drain_timeout_s: float = 1.0, engine: str = "cpu",
                 max_restarts: int = 3, placement=None, handoff_s: float = 0.0, tools=None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (got {num_workers})")
        self.slots, self.drain_timeout_s, self.max_restarts = slots, drain_timeout_s, max_restarts
        self.handoff_s = handoff_s
        gpus = worker_gpus(engine, engine_kwargs or {})
        have = ray.cluster_resources().get("GPU", 0) if gpus and not placement else gpus
        if have < gpus:  # else Ray would wait for them forever
            device = (engine_kwargs or {}).get("device")
            why = f"rollout.engine={engine}" + (f", rollout.device={device}" if device else "")
            raise ValueError(f"{why}: each rollout worker needs {gpus} GPU(s) and the Ray cluster has {have:g}")
        self._options = ((lambda i: placement.actor_options(ROLLOUT, i)) if placement
                         else (lambda i: {"num_gpus": gpus}))
        self._worker_args = (model_dir, slots, torch_threads, engine_kwargs, engine_entry(engine).build, tools)
        self.asleep: tuple[str, ...] = ()  # what every engine has given back (sleep) and not yet taken back
        self.sleep_level = 0
        self.workers = [self._new_worker(i) for i in range(num_workers)]
        with waiting(f"starting {num_workers} rollout engine(s)"):  # each loads the model
            ray.get([w.ready.remote() for w in self.workers])  # surface load errors here, not later
        self.outstanding = [0] * num_workers
        self.worker_of: dict[str, int] = {}  # request id -> worker, until its completion is collected
        self.requests: dict[str, Request] = {}  # the same span: what a replacement worker is given again
        self.aborted: set[str] = set()  # asked to abort: never given to a replacement
        # The last weights given to every worker, as the call that gives them to one, for a replacement worker:
        # this keeps one copy alive in the object store.
        self.weights: Callable[[ray.actor.ActorHandle], ObjectRef] | None = None
        self.restarts = 0
        self.deaths = [0] * num_workers  # per worker, in a row: reset when it finishes a request
        self._drains: dict[ObjectRef, int] = {self._arm(i): i for i in range(num_workers)}
        self.undelivered: list[Completion] = []  # cut by a death outside collect(): for the next collect()
        self.suspending: dict[str, Request] = {}  # cut by suspend(): their partials are not delivered ...
        self.suspended: list[Request] = []  # ... but continue from there at resume()
        self.on_hold = False  # between suspend() and resume()
        self.lent: list[int] = []  # between scale_down() and scale_up(): workers given no request
        self.moved = 0  # requests scale_down() moved, over the run

    @property
    def capacity(self) -> int:
        return self.slots * len(self.workers)

    def submit(self, requests: list[Request]) -> None:
        """Dispatch to the least-loaded workers. A worker checks its whole batch first: a batch with a
        bad request is refused (and forgotten here) and the error raised; other batches go on."""
        batches: dict[int, list[Request]] = defaultdict(list)
        seen: set[str] = set()
        for r in requests:
            if r.request_id in self.worker_of or r.request_id in seen:
                raise ValueError(f"request {r.request_id}: request_id already in flight")
            seen.add(r.request_id)
        serving = [i for i in range(len(self.workers)) if i not in self.lent]
        for r in requests:
            i = min(serving, key=self.outstanding.__getitem__)
            self.outstanding[i] += 1
            self.worker_of[r.request_id] = i
            self.requests[r.request_id] = r
            batches[i].append(r)
        calls = [(i, batch, self.workers[i].submit.remote(batch)) for i, batch in batches.items()]
        errors = []
        for i, batch, ref in calls:
            try:
                ray.get(ref)
            except RayActorError as e:  # the worker is dead: its replacement gets this batch too
                self.undelivered += self._replace(i, e)
            except RayTaskError as e:  # the worker refused the batch: forget it
                errors.append(e.as_instanceof_cause())  # still a ValueError for the caller
                for r in batch:
                    self._forget(r.request_id)
        if errors:
            raise errors[0]

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cut requests now; their partial completions arrive through collect(). Returns the ids cut
        (requests that already finished are not cut: their completions arrive as usual)."""
        by_worker: dict[int, list[str]] = defaultdict(list)
        for rid in request_ids:
            self.suspending.pop(rid, None)  # the caller's abort wins over a resume: its partial comes back
            if rid in self.worker_of:
                by_worker[self.worker_of[rid]].append(rid)
                self.aborted.add(rid)
        calls = [(i, ids, self.workers[i].abort.remote(ids)) for i, ids in by_worker.items()]
        cut = []
        for i, ids, ref in calls:
            try:
                cut += ray.get(ref)
            except RayActorError as e:  # the worker is dead: these come back cut from _replace
                lost = self._replace(i, e)
                self.undelivered += lost
                cut += [c.request_id for c in lost if c.request_id in ids]
        return cut

    def suspend(self) -> None:
        """Stop every request on the run's clock (training's), keeping what each has generated: it goes on from
        there at resume(). Eval runs while the clock is paused; training's requests generating meanwhile would
        make progress off the clock (schedulers that generate across a step: sorted, async)."""
        self.on_hold = True
        self.suspending.update({rid: self.requests[rid] for rid in self.abort(self._training_in_flight())})

    def scale_down(self) -> list[int]:
        """RollPacker's stream trainer (trainer.scale_down_at): the second half of the workers hand training's
        requests to the first half, each cut with its tokens and given again there at once (suspend's path, with
        no hold), and take no new request until scale_up(). Returns the workers freed."""
        self.lent = lent_engines(len(self.workers))
        moving = [rid for rid in self._training_in_flight() if self.worker_of[rid] in self.lent]
        cut = [rid for rid in self.abort(moving) if rid in self.requests]  # not: cut by a death, delivered as aborts
        self.suspending.update({rid: self.requests[rid] for rid in cut})
        self.moved += len(cut)
        return self.lent

    def scale_up(self) -> None:
        """Every worker takes requests again."""
        self.lent = []

    def drop_training(self) -> None:
        """Stop training's requests for good (the run is over): their partials come back as aborts."""
        self.abort(self._training_in_flight())

    def _training_in_flight(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.on_clock and rid not in self.aborted]

    def resume(self) -> None:
        """Give the suspended requests back to the engines (each prefills its prompt and its tokens again)."""
        self.on_hold = False
        again, self.suspended = self.suspended, []
        if again:
            self.submit(again)

    def _hold_suspended(self, completions: list[Completion]) -> list[Completion]:
        """The completions to deliver. A suspended request's partial becomes the request that continues it, kept
        for resume() (or given back at once if resume() came first); one that finished before the cut is
        delivered as usual."""
        out = []
        for c in completions:
            request = self.suspending.pop(c.request_id, None)
            if request is None or c.finish_reason != "abort":
                out.append(c)
                continue
            again = replace(request, **c.resume_fields())
            if self.on_hold:
                self.suspended.append(again)
            else:
                self.submit([again])
        return out

    def refs(self) -> list[ObjectRef]:
        return list(self._drains)

    def collect(self, ready_refs: list[ObjectRef]) -> list[Completion]:
        """Results of the ready drain calls (re-armed at once), plus any completions held back."""
        out, self.undelivered = self.undelivered, []
        for ref in ready_refs:
            if ref not in self._drains:
                raise KeyError(f"{ref} is not one of this manager's drain calls (take them from refs())")
            i = self._drains.pop(ref)
            self._drains[self._arm(i)] = i  # re-armed first, so a raised error leaves the manager usable
            try:
                completions = ray.get(ref)
            except RayActorError as e:
                out += self._replace(i, e)
                continue
            for c in completions:
                c.worker = i
                self._forget(c.request_id)
            if completions:
                self.deaths[i] = 0
            out.extend(completions)
        return self._hold_suspended(out)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run requests to completion and return them in order (`rlsys eval`). Only on otherwise idle workers:
        completions of other requests would come back here and be lost."""
        busy = len(self.worker_of) + len(self.undelivered)
        if busy:
            raise RuntimeError(f"generate: {busy} other requests are in flight or not yet collected; collect them "
                               "first (a run's controller generates evaluation through its own pump)")
        self.submit(requests)
        got: dict[str, Completion] = {}
        while len(got) < len(requests):
            ready, _ = ray.wait(self.refs(), num_returns=1)
            got.update((c.request_id, c) for c in self.collect(ready))
        return [got[r.request_id] for r in requests]

    def update_weights(self, update: WeightUpdate) -> None:
        """Blocking: every worker uses `update.version` for its next decode step. The sender has already put
        the buckets out (object store)."""
        self._give_every_worker(lambda w: w.update_weights.remote(update))

    def load_weights(self, weights: dict | ObjectRef, version: int) -> None:
        """Blocking: every worker loads this whole state dict (or an ObjectRef of one) as `version`."""
        ref = weights if isinstance(weights, ObjectRef) else ray.put(weights)
        self._give_every_worker(lambda w: w.load_weights.remote(ref, version))

    def _give_every_worker(self, weights: Callable[[ray.actor.ActorHandle], ObjectRef]) -> None:
        self.weights = weights  # first, so a worker replaced during the update starts from them
        self._on_every_worker(weights, ask_again=False)

    def sleep(self, level: int) -> None:
        """Every engine gives its accelerator memory back to the trainer (RolloutEngine.sleep); a worker whose
        engine still holds requests refuses, and its error is raised here."""
        self.asleep, self.sleep_level = SLEEP_TAGS, level  # first, so a worker replaced meanwhile starts asleep
        self._on_every_worker(lambda w: w.sleep.remote(level), ask_again=False)

    def wake_up(self, tags: list[str]) -> None:
        """Every engine takes back `tags`: "weights" before new weights are loaded, "kv_cache" after."""
        self.asleep = tuple(t for t in self.asleep if t not in tags)
        self._on_every_worker(lambda w: w.wake_up.remote(tags), ask_again=False)

    def receive_weights(self, update: WeightUpdate) -> dict[str, ObjectRef]:
        """Start every worker's receive of a version the trainer is sending now and return at once: their
        calls by name, to wait on together with the senders' (a death seen there goes to `worker_died`)."""
        return {f"rollout worker {i}": w.update_weights.remote(update)
                for i, w in enumerate(self.workers)}

    def gpus(self) -> list[tuple[str, list]]:
        """Each worker's node and Ray GPU ids."""
        return self._on_every_worker(lambda w: w.gpus.remote())

    def join_weight_group(self, host: str, port: int, world_size: int, ranks_per_worker: int, backend: str,
                          timeout_s: float) -> dict[str, ObjectRef]:
        """Start every worker's join of trainer rank 0's weight group, as ranks 1.. in worker order; their calls
        by name (each returns once every member has joined)."""
        return {f"rollout worker {i}": w.init_weight_group.remote(host, port, world_size, 1 + i * ranks_per_worker,
                                                                  backend, timeout_s)
                for i, w in enumerate(self.workers)}

    def worker_died(self, error: RayActorError) -> None:
        """A death the caller saw on a call it made itself: handled as any other (replaced, or refused)."""
        ids = {actor_id(w): i for i, w in enumerate(self.workers)}
        if error.actor_id in ids:
            self.undelivered += self._replace(ids[error.actor_id], error)

    def stats(self, window: tuple[float, float] | None = None) -> list[dict]:
        """Each worker's engine counters; with a wall-clock window, its occupied slot-seconds in it too
        (a replaced worker's counters start at its start)."""
        return self._on_every_worker(lambda w: w.stats.remote(window))

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.stop.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass  # already dead: nothing left to stop
            ray.kill(w)
        self.workers, self._drains = [], {}

    def _arm(self, i: int) -> ObjectRef:
        return self.workers[i].drain.remote(self.drain_timeout_s, self.handoff_s)

    def _new_worker(self, i: int):
        model_dir, slots, torch_threads, engine_kwargs, engine, tools = self._worker_args
        if isinstance((engine_kwargs or {}).get("pacer"), tuple):  # emulate: engine i's pacer
            engine_kwargs = {**engine_kwargs, "pacer": engine_kwargs["pacer"][i]}
        return RemoteRolloutWorker.options(**self._options(i)).remote(model_dir, slots, i, torch_threads,
                                                                      engine_kwargs, engine, tools)

    def _forget(self, request_id: str) -> None:
        i = self.worker_of.pop(request_id, None)
        if i is not None:
            self.outstanding[i] -= 1
            del self.requests[request_id]
            self.aborted.discard(request_id)

    def _on_every_worker(self, call, ask_again: bool = True) -> list:
        """`call(worker)` on every worker, results in order; a dead worker is replaced and, if `ask_again`,
        asked again (a replacement already has the last weights: an update need not reach it twice)."""
        refs = [call(w) for w in self.workers]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except RayActorError as e:
                self.undelivered += self._replace(i, e)
                out.append(ray.get(call(self.workers[i])) if ask_again else None)
        return out

    def _replace(self, i: int, error: RayActorError) -> list[Completion]:
        """Worker i died: start another with the last weights and give it i's requests again. Returns
        the completions of the requests the caller aborted: cut, with no new tokens, never run again."""
        self._check_died(i, error)
        if self.restarts_refused:
            raise RunStopped(f"rollout worker {i} died ({death_reason(error)}); {self.restarts_refused} cannot replace a "
                               "rollout worker yet (a new one would not get the weights). The run stopped; "
                               "`rlsys train` with the same config and --resume continues from the last "
                               "checkpoint") from error
        lost = [self.requests[rid] for rid, j in self.worker_of.items() if j == i]
        again = [r for r in lost if r.request_id not in self.aborted]
        cut = [self._cut(r, i) for r in lost if r.request_id in self.aborted]
        for c in cut:
            self._forget(c.request_id)
        self._drains = {ref: j for ref, j in self._drains.items() if j != i}
        while True:
            self.deaths[i] += 1
            why = death_reason(error)
            if self.deaths[i] > self.max_restarts:
                raise RunStopped(f"rollout worker {i} died {self.deaths[i]} times in a row without finishing "
                                 f"a request (rollout.max_restarts={self.max_restarts}); the last time: {why}"
                                 ) from error
            print(f"rollout worker {i} died ({why}); restarting it with its {len(again)} requests", flush=True)
            self.restarts += 1
            ray.kill(self.workers[i])  # unreachable is not always dead: make sure it is
            self.workers[i] = self._new_worker(i)
            try:
                self._prepare(self.workers[i], again)
                break
            except RayActorError as e:
                self._check_died(i, e)
                error = e
        self._drains[self._arm(i)] = i
        return cut

    def _check_died(self, i: int, error: RayActorError) -> None:
        """Raise `error` unless it is worker i's death: it may be another actor's, e.g. the trainer
        that was to make the weights passed to update_weights."""
        if error.actor_id != actor_id(self.workers[i]):
            raise error

    def _prepare(self, worker, requests: list[Request]) -> None:
        """In order (a worker runs calls concurrently): the model, the last weights, the others' sleep, then the
        requests."""
        ray.get(worker.ready.remote())
        if self.weights is not None:
            try:
                ray.get(self.weights(worker))
            except OwnerDiedError as e:  # a lost node took the trainer rank that put them in the object store
                raise RunStopped(f"a replacement rollout worker cannot load the last weights: the trainer rank that "
                                 f"held them was lost ({death_reason(e)}); --resume continues from the last "
                                 "checkpoint") from e
        if self.asleep:
            ray.get(worker.sleep.remote(self.sleep_level))
            ray.get(worker.wake_up.remote([t for t in SLEEP_TAGS if t not in self.asleep]))
        if requests:
            ray.get(worker.submit.remote(requests))

    @staticmethod
    def _cut(r: Request, worker: int) -> Completion:
        """What aborting a request before its first new token gives: only the tokens it resumed from."""
        now = time.time()
        return Completion(r.request_id, r.prompt_uid, list(r.prompt_ids), list(r.resume_ids),
                          list(r.resume_logprobs), list(r.resume_versions), "abort", worker=worker,
                          submit_time=now, start_time=now, end_time=now, mask=list(r.resume_mask),
                          turns=list(r.resume_turns))

