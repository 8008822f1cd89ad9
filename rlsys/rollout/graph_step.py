"""The built-in engine's decode step at static shapes, captured as CUDA graphs.

On a GPU a decode step of a small model is bound by the host: hundreds of kernel launches at 15-20 us each
against well under a millisecond of memory traffic (docs/performance.md, "Measured on an H100"). A CUDA graph
launches the whole step at once, but replays fixed shapes and fixed memory. So the static step decodes slots
0..B-1 in slot order, B a batch bucket, over K key positions, K a key-length bucket (shapes.py); a slot not
decoding this step writes to its scratch cache column (never attended), and keys past a row's length are masked
by the cache's mask. Its inputs are persistent buffers, filled by one copy from pinned host memory per step.
The step is a plain torch function: on the CPU it runs as is (no capture), the same code path.
"""
from __future__ import annotations

from typing import Callable

import torch


class DecodeGraphs:
    """CUDA graphs of the static step, one per shape (batch bucket, key bucket, sampling mode), captured on a
    shape's first use and sharing one memory pool. A graph reads the KV cache it was captured over: a
    reallocated cache (a wake after sleep) drops them all, and each shape is captured again on its next use."""

    def __init__(self):
        self.graphs: dict[tuple, object] = {}
        self.cache, self.pool = None, None

    def clear(self) -> None:
        """Give the graphs' memory back (the pool's blocks return when the last graph goes)."""
        self.graphs, self.cache, self.pool = {}, None, None

    def run(self, shape: tuple, step: Callable[[], None], cache: torch.Tensor) -> None:
        """Run `step` (idempotent: it writes only its outputs and cache positions it recomputes) as the graph of
        `shape`. A first use runs it eagerly, which also does the libraries' lazy set-up outside the capture,
        then captures it for the next time (a capture records without running)."""
        if cache is not self.cache:
            self.clear()
            self.cache = cache
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
            return
        step()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.graphs[shape] = graph
