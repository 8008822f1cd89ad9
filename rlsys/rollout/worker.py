"""A rollout worker: one engine driven by a background generation thread, served as a Ray actor.

Only the generation thread touches the engine (but for `interrupt_step`, made for other threads). Calls from the
driver (submit, abort, new weights) are queued and applied by that thread between two steps, in the order they
arrived, so a weight update lands between decode steps and in-flight requests simply continue under the new
weights.
Finished completions pile up until `drain` takes them. An error on the generation thread stops
the worker and is raised from the next call, never swallowed. While its engine sleeps (colocated
layout) no step runs: requests submitted meanwhile wait for it to wake.

With tools (`tools.fns`), every request is a conversation: when the model's turn ends at a tool call the engine
holds the sequence and the call goes to a pool of tool threads, so the generation thread keeps decoding the
others while the tool runs; the tool's answer, tokenized once on that thread, is appended between two steps and
the model goes on (RolloutEngine.use_tools). A conversation cut (abort) while its tool runs is cut once the
answer is in, so its partial carries the answer and resuming it never makes the call again.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import ray
import torch

from rlsys.rollout.engine import RolloutEngine
from rlsys.rollout.profile import StepProfiler
from rlsys.rollout.registry import make_engine
from rlsys.types import Completion, Request
from rlsys.weights import WeightUpdate

MAX_CONCURRENCY = 8  # a pending drain, plus submit/abort/update/stats calls beside it


class WorkerStopped(RuntimeError):
    pass


class RolloutWorker:
    def __init__(self, model_dir: str, slots: int, index: int = 0, torch_threads: int | None = None,
                 engine_kwargs: dict | None = None, engine: str | Callable[..., RolloutEngine] = "cpu",
                 tools=None):
        self.index, self.torch_threads = index, torch_threads
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine: RolloutEngine = make_engine(engine, model_dir, slots, name=f"rollout worker {index}",
                                                 **(engine_kwargs or {}))
        self._cond = threading.Condition()
        self._ops: list[tuple[Callable[[], Any], Future | None]] = []
        self._ready: list[Completion] = []
        self._engine_busy = False  # the engine had work left after its last finished completions
        self._error: BaseException | None = None  # the generation thread died of it
        self._submit_error: BaseException | None = None  # a submitted request was refused
        self._stopped = False
        self.tools = self._tool_pool = None
        self._cut_on_answer: set[str] = set()  # conversations aborted while their tool runs
        if tools is not None and (tools.fns or tools.env):  # a ToolsConfig: this worker builds its tools from it
            from rlsys.tools.box import ToolBox
            from rlsys.tools.format import ToolFormat

            fmt = ToolFormat.of(self.engine.tokenizer)
            self.tools = ToolBox.from_config(tools, fmt)
            self.engine.use_tools(fmt.call_open, fmt.call_close, tools.max_turns, tools.max_calls_per_turn,
                                  answer_turns=self.tools.env_responds)
            self._tool_pool = ThreadPoolExecutor(tools.max_workers, thread_name_prefix=f"rollout-worker-{index}-tool")
        self.engine.between_decode_steps = self._aborts_now
        self._thread = threading.Thread(target=self._loop, name=f"rollout-worker-{index}", daemon=True)
        self._thread.start()

    # --- called by the driver -----------------------------------------------------------------
    def ready(self) -> dict:
        return self.engine.load()

    def gpu_ids(self) -> list:
        """The GPUs Ray gave this actor (its placement bundle's)."""
        return ray.get_gpu_ids()

    def gpus(self) -> tuple[str, list]:
        """Its node and the GPUs Ray gave it: where a cuda_ipc sender must be."""
        return ray.util.get_node_ip_address(), ray.get_gpu_ids()

    def submit(self, requests: list[Request]) -> None:
        """Check and queue requests, then return at once (the generation thread adds them between steps).
        A bad request refuses the whole batch here; a later failure is raised from the next drain()."""
        for r in requests:
            self.engine.validate(r)

        def add_all():
            for r in requests:
                self.engine.add(r)
        self._enqueue(add_all, None)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cut these requests now; their partial completions come out of drain(). Returns the ids cut."""
        def cut():
            later = {rid for rid in request_ids if self.engine.waits_on_tool(rid)}
            self._cut_on_answer |= later
            done = self.engine.abort([rid for rid in request_ids if rid not in later])
            self._publish(done)
            return [c.request_id for c in done] + sorted(later)
        cut.between_decode_steps = True  # it may land inside a step that stands for many (_aborts_now)
        future: Future = Future()
        self._enqueue(cut, future)
        self.engine.interrupt_step()
        return future.result()

    def update_weights(self, update: WeightUpdate) -> None:
        """A version whose buckets are loaded as they arrive, in one go between two decode steps, so no step
        sees half the new weights."""
        def receive():
            self._check_awake(update.version)
            self.engine.receive_weights(update)
        self._call(receive)

    def load_weights(self, weights: dict, version: int) -> None:
        """A whole state dict (an evaluated checkpoint, tests), between two decode steps like `update_weights`."""
        def load():
            self._check_awake(version)
            self.engine.load_weights(weights, version)
        self._call(load)

    def _check_awake(self, version: int) -> None:
        if "weights" in self.engine.asleep:  # vLLM's would land in unmapped memory
            raise RuntimeError(f"rollout worker {self.index}: weights version {version} sent while its engine's "
                               "weights sleep; wake_up(['weights']) comes first")

    def sleep(self, level: int) -> None:
        """Give the engine's accelerator memory back to the trainer (between two steps); see RolloutEngine.sleep."""
        self._call(lambda: self.engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call(lambda: self.engine.wake_up(tags))

    def init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                          timeout_s: float) -> None:
        self._call(lambda: self.engine.init_weight_group(host, port, world_size, rank_offset, backend, timeout_s))

    def drain(self, timeout_s: float = 1.0, handoff_s: float = 0.0) -> list[Completion]:
        """Block until a completion is ready (or timeout), then return every ready one. With `handoff_s`, hold
        them that much longer while the engine still runs others: each call costs this process CPU that its
        decoding needs, so fewer, larger hand-overs generate faster. An engine out of work returns at once."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._error or self._submit_error or self._stopped,
                                timeout=timeout_s)
            if handoff_s and self._ready:
                self._cond.wait_for(lambda: self._error or self._submit_error or self._stopped
                                    or not self._engine_busy, timeout=handoff_s)
            if self._stopped and self._error is None:  # shut down on purpose: the last drain is not an error
                out, self._ready = self._ready, []
                return out
            self._raise_if_failed()
            if self._submit_error is not None:
                error, self._submit_error = self._submit_error, None
                raise error
            out, self._ready = self._ready, []
        return out

    def stats(self, window: tuple[float, float] | None = None) -> dict:
        """The engine's counters; with a wall-clock window, its occupied slot-seconds, decoding seconds and decode
        steps in it too (read on the generation thread, like everything of the engine's)."""
        def read():
            out = dict(self.engine.stats(), worker=self.index)
            if window is not None:
                out["occupied_slot_s"] = self.engine.counters.occupied_slot_s(*window)
                out["busy_s_in_window"] = self.engine.counters.busy_s_within(*window)
                out["decode_steps_in_window"] = self.engine.counters.decode_steps_within(*window)
            return out
        return self._call(read)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        if self._tool_pool is not None:
            self._tool_pool.shutdown(wait=False, cancel_futures=True)
            self.tools.close()

    # --- the generation thread ------------------------------------------------------------------
    def _loop(self) -> None:
        if self.torch_threads:  # thread counts can be per thread (OpenMP): set it here too
            torch.set_num_threads(self.torch_threads)
        profiler = StepProfiler.from_env(self.index, getattr(self.engine, "device", torch.device("cpu")))
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._ops or self._stopped or self._can_step())
                    if self._stopped:
                        break
                    ops, self._ops = self._ops, []
                for fn, future in ops:
                    self._run_op(fn, future)
                if self._can_step():
                    with profiler.step() if profiler else nullcontext():
                        self._publish(self.engine.step())
                for rid, at, text in self.engine.take_calls():
                    self._tool_pool.submit(self._run_tool, rid, at, text, time.monotonic(), self.engine.request_of(rid),
                                           self.engine.turns_of(rid), self.engine.model_turns_of(rid))
            if profiler:  # stopped inside a window: its report of the steps it saw (a failed step leaves it)
                profiler.close()
        except BaseException as e:  # noqa: BLE001 - handed to the driver, see _raise_if_failed
            with self._cond:
                self._error = e
                self._cond.notify_all()
        with self._cond:
            for _, future in self._ops:
                if future is not None:
                    future.set_exception(self._error or WorkerStopped(f"rollout worker {self.index} stopped"))
            self._ops = []

    def _aborts_now(self) -> None:
        """On the generation thread, inside a step (RolloutEngine.interrupt_step): the aborts queued ahead of
        any other op, applied in their order; an op behind another kind waits for the step's end with it."""
        with self._cond:
            n = next((i for i, (fn, _) in enumerate(self._ops) if not getattr(fn, "between_decode_steps", False)),
                     len(self._ops))
            ops, self._ops = self._ops[:n], self._ops[n:]
        for fn, future in ops:
            self._run_op(fn, future)

    def _can_step(self) -> bool:
        return self.engine.can_step() and not self.engine.asleep

    def _run_tool(self, request_id: str, at: int, call_text: str, made_at: float, request: Request,
                  turns: list, model_turns: list[str]) -> None:
        """On a tool thread: run the turn's calls, several at once (ToolBox.run_turn never raises, and keeps each
        to the time limit counted from `made_at`), or have the environment answer a turn without a call (its
        respond), tokenize the answers once, in call order, and hand the ids to the generation thread to append
        between two steps. An environment is reset with the request's sample (its prompt and reference answer:
        rlsys.types.env_sample), or the prompt's text alone when it carries none, and, in a new process (after a
        timeout, or the conversation cut and resumed), replayed to the conversation's `turns` so far (rlsys/tools/
        box.py user_env), the model's own turns' text being `model_turns`."""
        from rlsys.tools.box import conversation_messages  # with the tools: only a worker that has them

        try:
            sample = messages = None
            fmt, tokenizer = self.tools.fmt, self.engine.tokenizer
            if self.tools.env_spec:
                sample = request.sample or {"prompt": tokenizer.decode(request.prompt_ids)}
                messages = conversation_messages(sample.get("prompt", ""), model_turns, turns)
            if self.tools.env_responds and fmt.call_close not in call_text:  # a turn without a call (answer_turns)
                results = [self.tools.respond(messages, request_id, made_at, sample, turns)]
                ids = fmt.user_ids(tokenizer, results[0], call_text)
            else:
                results = self.tools.run_turn(call_text, request_id, made_at, sample, turns, messages)
                ids = fmt.responses_ids(tokenizer, results, call_text)
            turns, done = [r.turn for r in results], any(r.done for r in results)
            with self._cond:
                if self._stopped or self._error is not None:
                    return
                self._ops.append((lambda: self._answer(request_id, at, ids, turns, done), None))
                self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - a bug here stops the worker, reported like the loop's own
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    def _answer(self, request_id: str, at: int, ids: list[int], turns: list, done: bool) -> None:
        """On the generation thread: append a tool's answer; a conversation aborted meanwhile is cut now, and
        one its environment ended (`done`) ends with the answer ("stop")."""
        self.engine.extend(request_id, at, ids, turns)
        if request_id in self._cut_on_answer:
            self._cut_on_answer.discard(request_id)
            self._publish(self.engine.abort([request_id]))
        elif done:
            ended = self.engine.abort([request_id])
            for c in ended:
                c.finish_reason = "stop"
            self._publish(ended)

    def _run_op(self, fn: Callable[[], Any], future: Future | None) -> None:
        try:
            result = fn()
        except Exception as e:  # the caller's mistake (bad request, bad weights): report it, keep going
            if future is None:
                with self._cond:
                    self._submit_error = self._submit_error or e
                    self._cond.notify_all()
            else:
                future.set_exception(e)
            return
        if future is not None:
            future.set_result(result)

    def _publish(self, completions: list[Completion]) -> None:
        if not completions:
            return
        for c in completions:
            c.worker = self.index
            if self.tools is not None:  # the conversation is over (or cut): its tools' state goes
                self.tools.release(c.request_id)
        busy = self.engine.has_work()
        with self._cond:
            self._engine_busy = busy
            self._ready.extend(completions)
            self._cond.notify_all()

    def _enqueue(self, fn: Callable[[], Any], future: Future | None) -> None:
        with self._cond:
            self._raise_if_failed()
            self._ops.append((fn, future))
            self._cond.notify_all()

    def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()
        self._enqueue(fn, future)
        return future.result()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout worker {self.index}: the generation thread failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
        if self._stopped:
            raise WorkerStopped(f"rollout worker {self.index} stopped")


RemoteRolloutWorker = ray.remote(num_cpus=1, max_concurrency=MAX_CONCURRENCY)(RolloutWorker)
