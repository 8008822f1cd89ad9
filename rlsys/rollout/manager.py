"""The driver's handle on all rollout workers: dispatch, streaming completions, abort, weight sync.

Each worker always has exactly one `drain` call in flight; `refs()` hands those to the controller,
which waits on them together with other components' refs and passes the ready ones to `collect()`.
Requests go to the worker with the fewest outstanding requests (submitted, not yet collected).
"""
from __future__ import annotations

from collections import defaultdict

import ray
from ray import ObjectRef

from rlsys.rollout.worker import RemoteRolloutWorker
from rlsys.types import Completion, Request


def engine_options(cfg) -> dict:
    """Engine options from a run's Config: the KV cache sized to the longest prompt plus response."""
    kwargs = {"max_len": cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens}
    r = cfg.rollout
    if r.engine == "vllm":
        kwargs.update(tensor_parallel_size=r.tensor_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization,
                      enable_sleep_mode=r.enable_sleep_mode, dtype=r.dtype)
    return kwargs


class RolloutManager:
    @classmethod
    def from_config(cls, cfg, model_dir) -> "RolloutManager":
        """The run's engines, as `cfg.rollout` and `cfg.cluster` describe them."""
        return cls(str(model_dir), cfg.rollout.num_workers, cfg.rollout.slots, torch_threads=cfg.cluster.torch_threads,
                   engine_kwargs=engine_options(cfg), engine=cfg.rollout.engine)

    def __init__(self, model_dir: str, num_workers: int, slots: int, torch_threads: int | None = None,
                 engine_kwargs: dict | None = None, drain_timeout_s: float = 1.0, engine: str = "cpu"):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (got {num_workers})")
        self.slots, self.drain_timeout_s = slots, drain_timeout_s
        gpus = (engine_kwargs or {}).get("tensor_parallel_size", 1) if engine == "vllm" else 0
        self.workers = [RemoteRolloutWorker.options(num_gpus=gpus).remote(model_dir, slots, i, torch_threads,
                                                                          engine_kwargs, engine)
                        for i in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])  # surface load errors here, not later
        self.outstanding = [0] * num_workers
        self.owner: dict[str, int] = {}  # request id -> worker, until its completion is collected
        self._drains: dict[ObjectRef, int] = {self._arm(i): i for i in range(num_workers)}
        self.held: list[Completion] = []  # collected by generate() for other callers

    @property
    def capacity(self) -> int:
        return self.slots * len(self.workers)

    def submit(self, requests: list[Request]) -> None:
        """Dispatch to the least-loaded workers. A worker checks its whole batch first: a batch with a
        bad request is refused (and forgotten here) and the error raised; other batches go on."""
        batches: dict[int, list[Request]] = defaultdict(list)
        seen: set[str] = set()
        for r in requests:
            if r.request_id in self.owner or r.request_id in seen:
                raise ValueError(f"request {r.request_id}: request_id already in flight")
            seen.add(r.request_id)
        for r in requests:
            i = min(range(len(self.workers)), key=self.outstanding.__getitem__)
            self.outstanding[i] += 1
            self.owner[r.request_id] = i
            batches[i].append(r)
        calls = [(i, batch, self.workers[i].submit.remote(batch)) for i, batch in batches.items()]
        errors = []
        for i, batch, ref in calls:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the worker refused the batch: forget it
                errors.append(e.as_instanceof_cause())  # still a ValueError for the caller
                for r in batch:
                    del self.owner[r.request_id]
                self.outstanding[i] -= len(batch)
        if errors:
            raise errors[0]

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cut requests now; their partial completions arrive through collect(). Returns the ids cut
        (requests that already finished are not cut: their completions arrive as usual)."""
        by_worker: dict[int, list[str]] = defaultdict(list)
        for rid in request_ids:
            if rid in self.owner:
                by_worker[self.owner[rid]].append(rid)
        cut = ray.get([self.workers[i].abort.remote(ids) for i, ids in by_worker.items()])
        return [rid for ids in cut for rid in ids]

    def refs(self) -> list[ObjectRef]:
        return list(self._drains)

    def collect(self, ready_refs: list[ObjectRef]) -> list[Completion]:
        """Results of the ready drain calls (re-armed at once), plus any completions held back."""
        out, self.held = self.held, []
        for ref in ready_refs:
            if ref not in self._drains:
                raise KeyError(f"{ref} is not one of this manager's drain calls (take them from refs())")
            i = self._drains.pop(ref)
            self._drains[self._arm(i)] = i  # re-armed first, so a raised error leaves the manager usable
            completions = ray.get(ref)
            for c in completions:
                c.worker = i
                if self.owner.pop(c.request_id, None) is not None:
                    self.outstanding[i] -= 1
            out.extend(completions)
        return out

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run requests to completion and return them in order; other completions are kept for collect()."""
        wanted = {r.request_id for r in requests}
        self.submit(requests)
        got: dict[str, Completion] = {}
        others: list[Completion] = []
        while len(got) < len(wanted):
            ready, _ = ray.wait(self.refs(), num_returns=1)
            for c in self.collect(ready):
                if c.request_id in wanted:
                    got[c.request_id] = c
                else:
                    others.append(c)
        self.held = others + self.held
        return [got[r.request_id] for r in requests]

    def update_weights(self, state_dict, version: int) -> None:
        """Blocking: every worker uses `version` for its next decode step. Takes a dict or an ObjectRef."""
        ref = state_dict if isinstance(state_dict, ObjectRef) else ray.put(state_dict)
        ray.get([w.update_weights.remote(ref, version) for w in self.workers])

    def stats(self, window: tuple[float, float] | None = None) -> list[dict]:
        """Each worker's engine counters; with a wall-clock window, its occupied slot-seconds in it too."""
        return ray.get([w.stats.remote(window) for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.stop.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass  # already dead: nothing left to stop
            ray.kill(w)
        self.workers, self._drains = [], {}

    def _arm(self, i: int) -> ObjectRef:
        return self.workers[i].drain.remote(self.drain_timeout_s)
