"""Weight buckets: an ordered, Hugging Face-named state dict cut into flat byte buffers under a size budget.

One bucket is one message on the wire (an object in Ray's store, one broadcast, one CUDA IPC handle):
fewer, larger messages than one per tensor, and a bounded buffer instead of a second copy of the model.
A `BucketPlan` is the metadata alone (names, shapes, dtypes, byte offsets), so a receiver can allocate
its buffer before the bytes arrive (planned from shapes alone: tensors on the "meta" device will do);
`pack` and `unpack` are an exact round trip. A publishing trainer never holds its weights whole:
`fill_buckets` packs parameters as they are read, one at a time, into a few reusable buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

ALIGN = 16  # every tensor starts on a 16-byte boundary, so its slice can be viewed as any dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the bucket

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    tensors: tuple[TensorMeta, ...]
    nbytes: int

    def describe(self, index: int) -> str:
        """'bucket 3 (model.layers.1.mlp.up_proj.weight .. model.norm.weight, 4 tensors)', for errors."""
        first, last = self.tensors[0].name, self.tensors[-1].name
        names = first if first == last else f"{first} .. {last}"
        return f"bucket {index} ({names}, {len(self.tensors)} tensors)"


def plan_buckets(weights: Mapping[str, Tensor], budget_bytes: int, dtype: torch.dtype | None = None
                 ) -> list[BucketPlan]:
    """Cut the weights, in their order, into buckets of at most `budget_bytes` (a larger tensor gets a
    bucket of its own). With `dtype`, floating-point tensors travel in that dtype (e.g. the engine's)."""
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1 (got {budget_bytes})")
    plans, current, size = [], [], 0
    for name, t in weights.items():
        wire = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * wire.itemsize
        start = _aligned(size)
        if current and start + nbytes > budget_bytes:
            plans.append(BucketPlan(tuple(current), size))
            current, start = [], 0
        current.append(TensorMeta(name, tuple(t.shape), wire, start))
        size = start + nbytes
    if current:
        plans.append(BucketPlan(tuple(current), size))
    return plans


def pack(plan: BucketPlan, weights: Mapping[str, Tensor], device: torch.device | str | None = None) -> Tensor:
    """One uint8 buffer holding the plan's tensors (cast to their wire dtype) at their offsets."""
    first = weights[plan.tensors[0].name]
    flat = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device if device is not None else first.device)
    for meta in plan.tensors:
        write(flat, meta, weights[meta.name])
    return flat


def write(flat: Tensor, meta: TensorMeta, tensor: Tensor) -> None:
    """Copy `tensor` into its place in a bucket buffer, cast on the way: no copy of it besides."""
    if tuple(tensor.shape) != meta.shape:
        raise ValueError(f"{meta.name}: shape {tuple(tensor.shape)} does not match the plan's {meta.shape}")
    flat[meta.offset:meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape).copy_(tensor.detach())


def fill_buckets(plans: list[BucketPlan], weights: Iterable[tuple[str, Tensor]], buffers: list[Tensor],
                 reuse: Callable[[int], None]) -> Iterator[tuple[int, BucketPlan, Tensor]]:
    """Pack (name, tensor) pairs as they come, in the plans' order, into `buffers` in turn: bucket i goes to
    buffers[i % len(buffers)]. `reuse(i)` runs before bucket i overwrites a buffer, so the caller can first
    wait until the receivers are done with the bucket it held. Yields (i, plan, bucket as a view)."""
    pairs = iter(weights)
    for i, plan in enumerate(plans):
        reuse(i)
        flat = buffers[i % len(buffers)][:plan.nbytes]
        for meta in plan.tensors:
            name, tensor = next(pairs, (None, None))
            if name != meta.name:
                raise ValueError(f"{plan.describe(i)}: expected {meta.name} next, the weights gave {name}")
            write(flat, meta, tensor)
        yield i, plan, flat
    extra = next(pairs, None)
    if extra is not None:
        raise ValueError(f"{extra[0]}: not in the bucket plans (the weights have more tensors than planned)")


def unpack(plan: BucketPlan, flat: Tensor) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs in plan order; the tensors are views into `flat` (no copy)."""
    if flat.dtype != torch.uint8 or flat.numel() != plan.nbytes:
        raise ValueError(f"bucket buffer is {flat.dtype} x {flat.numel()}, the plan expects uint8 x {plan.nbytes}")
    return [(m.name, flat[m.offset:m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in plan.tensors]


def iter_buckets(weights: Mapping[str, Tensor], budget_bytes: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> Iterator[tuple[BucketPlan, Tensor]]:
    """Plan and pack bucket by bucket: only one bucket's buffer exists at a time."""
    for plan in plan_buckets(weights, budget_bytes, dtype):
        yield plan, pack(plan, weights, device)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
