"""The reward actor pool: scores completions as they arrive, on Ray actors, and never stops the run.

The driver keeps one queue; each idle worker takes the next few items in one call (one call in flight
per worker, so an idle worker is by definition the least loaded). Faults become the fallback reward
with an error string, counted in `errors`:
- the function raises or returns junk (not a finite number within `reward.valid_range`): caught in
  the worker, per item;
- it runs past `timeout_s`: the worker stops waiting for it, reports the timeout, and is replaced,
  since the thread it ran on may be stuck forever;
- the worker does not answer by its deadline (e.g. a regex holding the GIL): the driver kills and
  replaces it; a lone item gets the fallback, items of a larger call are retried one by one;
- the worker dies: it is replaced and its items are retried once, alone, on a worker that answered since
  (the others on a lost node die with it);
Each fault is logged with its sample and reason: the first ten, then the 20th, 30th, ..., 100th, 200th...

The reward function travels to the workers pickled: functions of rlsys by reference (imported there),
any other (a test module, a user script) by value, so it need not be importable in the workers. With several
(`reward.fn` a list) each sample's result carries each part's value too. A reward model (`reward_model` among
them) is loaded in each worker, on `reward.model.device`, and scores a call's items `reward.model.batch_size` at
a time before their functions run; a forward past `timeout_s` is a timeout of its items.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import ray
from ray import cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError

from rlsys.config import RewardConfig
from rlsys.reward.registry import Part, describe, reward_parts, score_parts

GRACE_S = 2.0  # driver deadline slack for Ray's round trip, beyond the workers' own per-item timeouts
START_TIMEOUT_S = 120.0
MAX_BATCH = 32
log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    key: str
    reward: float
    error: str | None = None
    parts: dict[str, float] | None = None  # each part's value, where reward.fn names several


@dataclass
class _Item:
    key: str
    response: str
    answer: str
    num_tokens: int
    data_source: str = ""  # the prompt's, for a veRL-style reward function
    extra_info: dict | None = None
    prompt: str = ""  # the text the policy was given, for a reward model
    retried: bool = False  # lost once with a worker already; retried items go alone


@dataclass
class _Call:
    worker: int
    items: list[_Item] = field(default_factory=list)  # empty: the worker's start-up call
    deadline: float = 0.0


def worth_logging(n: int) -> bool:
    """The first 10 errors, then 20, 30, ..., 100, 200, ...: a trickle that never floods the log."""
    return n <= 10 or n % 10 ** (len(str(n)) - 1) == 0


class RewardWorker:
    """One reward actor. Runs the function on a side thread so it can stop waiting for a hung call."""

    def __init__(self, cfg: RewardConfig, parts_blob: bytes):
        self.cfg = cfg
        parts = cloudpickle.loads(parts_blob)
        self.parts: list[Part] = parts if isinstance(parts, list) else [Part(cfg.names[0], parts)]  # or one function
        for part in self.parts:
            if hasattr(part.fn, "setup"):  # e.g. code_tests builds its sandbox: a refusal fails the pool's start
                part.fn.setup(cfg)
        self.model = None
        if any(part.fn is None for part in self.parts):
            from rlsys.reward.model import RewardModel  # torch and transformers: only where a model is scored
            self.model = RewardModel(cfg.model)
        self.runner = ThreadPoolExecutor(1)

    def ready(self) -> bool:
        return True

    def score_batch(self, items: list[tuple]) -> tuple[list[RewardResult], bool]:
        """Results for a prefix of `items` (the pool's submit's), and whether the runner thread is stuck (stop
        and replace)."""
        cfg, results, items = self.cfg, [], [_Item(*item) for item in items]
        size = self.model.batch_size if self.model else max(1, len(items))
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            model_scores, error = [None] * len(chunk), None
            if self.model:
                job = self.runner.submit(self.model.score, [(it.prompt, it.response) for it in chunk])
                if not wait([job], timeout=cfg.timeout_s).done:
                    timeout = f"timeout after {cfg.timeout_s}s (reward model)"
                    return results + [RewardResult(it.key, cfg.fallback, timeout) for it in chunk], True
                try:
                    model_scores = job.result()
                except Exception as e:  # every item of the forward falls back
                    error = f"reward model {describe(e)}"
            for it, model_score in zip(chunk, model_scores):
                if error:
                    results.append(RewardResult(it.key, cfg.fallback, error))
                    continue
                job = self.runner.submit(score_parts, cfg, self.parts, it.response, it.answer, it.num_tokens,
                                         it.data_source, it.extra_info, model_score)
                if not wait([job], timeout=cfg.timeout_s).done:
                    results.append(RewardResult(it.key, cfg.fallback, f"timeout after {cfg.timeout_s}s"))
                    return results, True
                try:
                    reward, parts = job.result()
                    results.append(RewardResult(it.key, reward, parts=parts if len(self.parts) > 1 else None))
                except Exception as e:  # the user's code: any error becomes the fallback
                    results.append(RewardResult(it.key, cfg.fallback, describe(e)))
        return results, False


# Each worker holds a CPU, as the rollout workers do: with Ray's default (one CPU to be placed, none held)
# every worker of the pool lands on the same node, whatever its cores.
_RemoteWorker = ray.remote(num_cpus=1)(RewardWorker)


def _pickle(parts: list[Part]) -> bytes:
    """The parts, each function of the user's by value (its module registered for the dump only)."""
    modules = {inspect.getmodule(part.fn) for part in parts if inspect.isfunction(part.fn)}
    registering = {m for m in modules if m is not None and not m.__name__.startswith("rlsys.")
                   and m.__name__ not in cloudpickle.list_registry_pickle_by_value()}
    for module in registering:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(parts)
    finally:
        for module in registering:
            cloudpickle.unregister_pickle_by_value(module)


class RewardPool:
    """`cfg.num_workers` reward actors fed from one queue. Use from the driver only (not thread-safe)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        parts = reward_parts(cfg)  # an unknown name fails here, listing the known ones
        self._parts_blob = _pickle(parts)
        self._model_batch = cfg.model.batch_size if any(part.fn is None for part in parts) else 0
        on_gpu = self._model_batch and cfg.model.device == "cuda"  # a reward model on cuda: a GPU for each worker
        self._remote = _RemoteWorker.options(num_gpus=1) if on_gpu else _RemoteWorker
        self.errors = 0  # samples that got the fallback: logged as reward/errors
        self.restarts = 0  # workers killed or lost and replaced
        self._queue: deque[_Item] = deque()
        self._calls: dict[ray.ObjectRef, _Call] = {}
        self._idle: set[int] = set()
        self._start_failures = [0] * cfg.num_workers  # in a row, per worker slot
        self.workers: list = [None] * cfg.num_workers
        for i in range(cfg.num_workers):
            self._start(i)
        try:  # wait here, so a function that cannot load in the workers fails now, not mid-run
            ray.get(self.refs(), timeout=START_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            self.shutdown()
            raise RuntimeError(f"reward workers for {cfg.fn!r} did not start: {e}") from e
        self._calls.clear()
        self._idle = set(range(cfg.num_workers))

    # -- the streaming API the controller uses --------------------------------------------------

    def submit(self, items: list[tuple]) -> None:
        """Queue (key, response, answer, num_tokens[, data_source, extra_info[, prompt]]) items (the source and info
        for a veRL-style reward function, the prompt for a reward model), then dispatch once: items handed over together
        leave in as few calls as the idle workers allow, not the first alone and the rest after it."""
        self._queue.extend(_Item(*item) for item in items)
        self._dispatch()

    def refs(self) -> list[ray.ObjectRef]:
        """Calls in flight (start-ups included), for a `ray.wait` over every component."""
        return list(self._calls)

    def collect(self, ready_refs: list) -> list[RewardResult]:
        """Results of the given finished calls; refs that are not the pool's are ignored."""
        results = []
        for ref in ready_refs:
            call = self._calls.pop(ref, None)
            if call is None:
                continue
            try:
                out = ray.get(ref)
            except RayActorError as e:
                results += self._lost(call, e)
                continue
            if call.items:
                results += self._scored(call, *out)
            else:
                self._start_failures[call.worker] = 0
                self._idle.add(call.worker)
        self._dispatch()
        return self._counted(results)

    def reap(self) -> list[RewardResult]:
        """Fallbacks for calls past their deadline; their workers are killed and replaced."""
        now, results = time.monotonic(), []
        for ref, call in list(self._calls.items()):
            if now < call.deadline:
                continue
            del self._calls[ref]
            if not call.items:
                raise RuntimeError(f"reward worker did not start within {START_TIMEOUT_S}s "
                                   "(is the Ray cluster out of CPUs?)")
            self._replace(call.worker)
            if len(call.items) == 1:
                results.append(RewardResult(call.items[0].key, self.cfg.fallback,
                                            f"timeout after {self.cfg.timeout_s}s"))
            else:  # which item hung is unknown: retry each alone
                results += self._retry_or_fail(call.items, f"timeout after {self.cfg.timeout_s}s")
        self._dispatch()
        return self._counted(results)

    # -- conveniences --------------------------------------------------------------------------

    def score_all(self, items: list[tuple]) -> list[RewardResult]:
        """Score items as `submit` takes them and wait: results in input order (`rlsys eval`).
        Only on an otherwise idle pool: results of other items would come back here and be lost."""
        keys = [item[0] for item in items]
        if len(set(keys)) != len(keys):
            raise ValueError("score_all: keys must be unique")
        if self.unscored():
            raise RuntimeError(f"score_all: {self.unscored()} other items are being scored; collect them first (a "
                               "run's controller scores evaluation through its own pump)")
        self.submit(items)
        by_key = {}
        while len(by_key) < len(keys):
            next_deadline = min(c.deadline for c in self._calls.values())
            ready, _ = ray.wait(self.refs(), num_returns=1,
                                timeout=max(0.01, next_deadline - time.monotonic()))
            by_key.update((r.key, r) for r in self.collect(ready) + self.reap())
        return [by_key[k] for k in keys]

    def unscored(self) -> int:
        """Items submitted whose results have not come back: queued or in a call."""
        return len(self._queue) + sum(len(call.items) for call in self._calls.values())

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self._calls.clear()
        self._queue.clear()
        self._idle.clear()

    # -- internals -----------------------------------------------------------------------------

    def _start(self, i: int) -> None:
        self.workers[i] = self._remote.remote(self.cfg, self._parts_blob)
        self._ask_ready(i)

    def _ask_ready(self, i: int) -> None:
        """Worker i is idle again once it answers ready(), within START_TIMEOUT_S (see reap)."""
        self._calls[self.workers[i].ready.remote()] = _Call(i, deadline=time.monotonic() + START_TIMEOUT_S)

    def _replace(self, i: int) -> None:
        ray.kill(self.workers[i])
        self._idle.discard(i)
        self.restarts += 1
        self._start(i)

    def _dispatch(self) -> None:
        while self._queue and self._idle:
            batch = [self._queue.popleft()]
            size = min(max(MAX_BATCH, self._model_batch), math.ceil((len(self._queue) + 1) / len(self.workers)))
            while not batch[0].retried and len(batch) < size and self._queue and not self._queue[0].retried:
                batch.append(self._queue.popleft())
            i = self._idle.pop()
            payload = [(it.key, it.response, it.answer, it.num_tokens, it.data_source, it.extra_info, it.prompt)
                       for it in batch]
            ref = self.workers[i].score_batch.remote(payload)
            forwards = math.ceil(len(batch) / self._model_batch) if self._model_batch else 0  # each up to timeout_s
            self._calls[ref] = _Call(i, batch, time.monotonic() + (len(batch) + forwards) * self.cfg.timeout_s
                                     + GRACE_S)

    def _scored(self, call: _Call, done: list[RewardResult], stuck: bool) -> list[RewardResult]:
        self._queue.extendleft(reversed(call.items[len(done):]))  # never ran: back to the front
        if stuck:
            self._replace(call.worker)
        else:
            self._idle.add(call.worker)
        return done

    def _lost(self, call: _Call, error: RayActorError) -> list[RewardResult]:
        """The worker died: replace it; retry its items (or its start, a few times)."""
        if not call.items:
            self._start_failures[call.worker] += 1
            if self._start_failures[call.worker] >= 3:
                raise RuntimeError(f"reward worker for {self.cfg.fn!r} failed to start 3 times: {error}")
        self._replace(call.worker)
        self._recheck_idle()
        return self._retry_or_fail(call.items, f"worker died: {type(error).__name__}")

    def _recheck_idle(self) -> None:
        """A lost node takes every worker on it, and an idle one's death shows only when it is called: ask the
        idle workers whether they live before a retried item (one death left) goes to one of them."""
        for i in self._idle:
            self._ask_ready(i)
        self._idle.clear()

    def _retry_or_fail(self, items: list[_Item], error: str) -> list[RewardResult]:
        """Items lost with a worker: back to the front of the queue once, then the fallback."""
        failed = [RewardResult(it.key, self.cfg.fallback, error) for it in items if it.retried]
        retry = [it for it in items if not it.retried]
        for it in reversed(retry):
            it.retried = True
            self._queue.appendleft(it)
        return failed

    def _counted(self, results: list[RewardResult]) -> list[RewardResult]:
        for r in results:
            if r.error is None:
                continue
            self.errors += 1
            if worth_logging(self.errors):
                log.warning("reward error %d (sample %s): %s; it gets the fallback reward %g",
                            self.errors, r.key, r.error, self.cfg.fallback)
        return results
