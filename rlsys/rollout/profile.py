"""A diagnosis of a rollout worker's engine steps inside a real run, for when a step is slower there than alone.

With RLSYS_PROFILE_ENGINE=DIR in the run's environment (Ray's workers inherit it), each rollout worker's
generation thread profiles windows of `steps` engine steps with torch's profiler (host ops and, on a GPU,
kernels): the first from step `skip`, then every `every` steps, `windows` of them; meanwhile a sampler thread
reads every Python thread's innermost frame each `sample_s`. Each window writes DIR/engine-<worker>-<first
step>.txt, for people to read: the wall time per step, the time its ops and kernels took, and where every
thread of the process was. Slow kernels point at the device (another process on the GPU), fast kernels with a
slow wall at the host (the generation thread waiting for the GIL held by the thread the samples show busy).
A run that ends inside a window gets the report of the steps it saw (`close`).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

ENV = "RLSYS_PROFILE_ENGINE"


class StepProfiler:
    """A rollout worker's windows of profiled engine steps (the module's docstring), driven by its generation
    thread alone: `step()` around each engine step, `close()` when the worker stops."""

    def __init__(self, folder: str | Path, worker: int, device: torch.device, skip: int = 50, steps: int = 20,
                 every: int = 250, windows: int = 4, sample_s: float = 0.001):
        if not 0 < steps <= every:  # torch's profiler runs one window at a time
            raise ValueError(f"{ENV}: a window of steps={steps} must fit between two starts (every={every})")
        self.folder, self.worker = Path(folder), worker
        self.on_gpu = device.type == "cuda"  # its kernels profiled too, and waited for at a window's end
        self.starts = {skip + i * every for i in range(windows)}
        self.steps, self.sample_s = steps, sample_s
        self.seen = 0  # engine steps taken
        self.window: _Window | None = None

    @classmethod
    def from_env(cls, worker: int, device: torch.device) -> StepProfiler | None:
        folder = os.environ.get(ENV)
        return cls(folder, worker, device) if folder else None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step, on the thread that steps it: a window opens at its first step and its report
        is written after its last."""
        if self.window is None and self.seen in self.starts:
            self.window = _Window(self.seen, self.on_gpu, self.sample_s)
        start = time.perf_counter()
        yield
        self.seen += 1
        if self.window is not None:
            if self.seen - self.window.first == self.steps:
                self.close(start)
            else:
                self.window.in_steps_s += time.perf_counter() - start

    def close(self, last_step_start: float | None = None) -> None:
        """End the open window, if any, and write its report: after its last step, or where the run stopped."""
        window, self.window = self.window, None
        if window is None:
            return
        if self.on_gpu:
            torch.cuda.synchronize()
        end = time.perf_counter()
        if last_step_start is not None:
            window.in_steps_s += end - last_step_start
        window.stop()
        if self.seen == window.first:  # its first step never finished: nothing to report
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        report = window.report(self.seen - window.first, end, ended_early=last_step_start is None)
        (self.folder / f"engine-{self.worker}-{window.first}.txt").write_text(report)


class _Window:
    """One profiled window: torch's profiler entered on the generation thread, a thread sampling every frame."""

    def __init__(self, first: int, on_gpu: bool, sample_s: float):
        self.first, self.on_gpu = first, on_gpu
        self.in_steps_s = 0.0  # inside the engine's steps: the loop's work between them and its waits left out
        self.samples: collections.Counter = collections.Counter()
        self.stopped = threading.Event()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities)
        self.profile.__enter__()
        self.sampler = threading.Thread(target=self._sample, args=(threading.current_thread(), sample_s),
                                        name="engine-step-profiler", daemon=True)
        self.sampler.start()
        self.start = time.perf_counter()

    def _sample(self, generating: threading.Thread, period_s: float) -> None:
        """Each thread's innermost frame until the window stops (each sample takes the GIL: its period stays
        coarse)."""
        names: dict[int, str] = {}
        while not self.stopped.wait(period_s):
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                if ident not in names:  # a thread started since: read the names once
                    names.update((t.ident, t.name) for t in threading.enumerate())
                    names.setdefault(ident, f"thread {ident}")  # not started by `threading`
                where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
                who = "generation thread" if ident == generating.ident else names[ident]
                self.samples[(who, where)] += 1

    def stop(self) -> None:
        self.stopped.set()
        self.sampler.join()
        self.profile.__exit__(None, None, None)

    def report(self, steps: int, end: float, ended_early: bool) -> str:
        events = self.profile.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        host_us = sum(e.self_cpu_time_total for e in events)
        span_s = end - self.start
        lines = [f"steps {steps} after {self.first}: wall {1000 * self.in_steps_s / steps:.2f} ms a step, "
                 f"kernels {device_us / 1000 / steps:.2f} ms, host ops {host_us / 1000 / steps:.2f} ms",
                 f"window {1000 * span_s:.1f} ms from its first step's start to its last's end "
                 f"({1000 * span_s / steps:.2f} ms a step): the wall above counts the engine's steps only; the "
                 "ops and kernels, and the samples below, also the loop's work between them (submits, weights)"]
        if ended_early:
            lines.append(f"the worker stopped inside this window, after {steps} of its steps")
        lines += ["", "python frames sampled (thread, frame): count"]
        lines += [f"{n:6d}  {who}: {where}" for (who, where), n in self.samples.most_common(40)]
        lines += ["", events.table(sort_by="self_cpu_time_total", row_limit=25)]
        if self.on_gpu:
            lines += ["", events.table(sort_by="self_cuda_time_total", row_limit=25)]
        return "\n".join(lines) + "\n"
