"""A diagnosis of a rollout worker's engine steps inside a real run, for when a step is slower there than alone.

With RLSYS_PROFILE_ENGINE=DIR in the run's environment (Ray's workers inherit it), each rollout worker's
generation thread profiles `steps` steps with torch's profiler (host ops and, on a GPU, kernels) every `every`
steps from step `skip` on, `windows` times, while a sampler thread reads every Python thread's frame each
millisecond. Each window writes DIR/engine-<worker>-<first step>.txt: the wall time per step, the time its ops and kernels took, and where every
thread of the process was. Slow kernels point at the device (another process on the GPU), fast kernels with a
slow wall at the host (the generation thread waiting for the GIL held by the thread the samples show busy).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

import torch

ENV = "RLSYS_PROFILE_ENGINE"


class StepProfiler:
    def __init__(self, folder: str | Path, worker: int, device: torch.device, skip: int = 50, steps: int = 20,
                 every: int = 250, windows: int = 4, sample_s: float = 0.001):
        self.folder, self.worker = Path(folder), worker
        self.on_gpu = device.type == "cuda"  # its kernels profiled too, and waited for at a window's end
        self.starts = [skip + i * every for i in range(windows)]
        self.steps, self.sample_s = steps, sample_s
        self.seen = 0
        self._profile = self._sampler = self._start = None

    @classmethod
    def from_env(cls, worker: int, device: torch.device) -> StepProfiler | None:
        folder = os.environ.get(ENV)
        return cls(folder, worker, device) if folder else None

    def before_step(self) -> None:
        if self.seen in self.starts:
            self._samples: collections.Counter = collections.Counter()
            self._stop = threading.Event()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
            self._sampler = threading.Thread(target=self._sample, args=(threading.get_ident(),), daemon=True)
            self._sampler.start()
            self._start = time.perf_counter()

    def after_step(self) -> None:
        self.seen += 1
        if self._start is not None and self.seen - self.steps in self.starts:
            if self.on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._start
            self._stop.set()
            self._sampler.join()
            self._profile.__exit__(None, None, None)
            self._write(wall)
            self._start = None

    def _sample(self, generating: int) -> None:
        """Each thread's innermost frame, sampled (the GIL is taken for each sample: its period stays coarse)."""
        names: dict[int, str] = {}
        while not self._stop.wait(self.sample_s):
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                if ident not in names:  # a thread started since
                    names.update((t.ident, t.name) for t in threading.enumerate())
                where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
                who = "generation thread" if ident == generating else names.get(ident, str(ident))
                self._samples[(who, where)] += 1

    def _write(self, wall: float) -> None:
        events = self._profile.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        host_us = sum(e.self_cpu_time_total for e in events)
        first = self.seen - self.steps
        lines = [f"steps {self.steps} after {first}: wall {1000 * wall / self.steps:.2f} ms a step, "
                 f"kernels {device_us / 1000 / self.steps:.2f} ms, host ops {host_us / 1000 / self.steps:.2f} ms",
                 "", "python frames sampled (thread, frame): count"]
        lines += [f"{n:6d}  {who}: {where}" for (who, where), n in self._samples.most_common(40)]
        lines += ["", events.table(sort_by="self_cpu_time_total", row_limit=25)]
        if self.on_gpu:
            lines += ["", events.table(sort_by="self_cuda_time_total", row_limit=25)]
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"engine-{self.worker}-{first}.txt").write_text("\n".join(lines) + "\n")
