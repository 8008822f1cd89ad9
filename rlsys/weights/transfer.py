"""How a version of the weights travels from the trainer to the engines' workers, bucket by bucket.

Trainer side: `send(buckets)` runs where the full weights are (trainer rank 0: the HF-named dict from
`TrainerBackend.state_dict_for_rollout()`, which under ZeRO-3 gathers on every rank) and returns what the
receivers need besides the plans. Engine side: `receive(plans, ticket, device)` runs in each engine worker
(inside vLLM through rollout/vllm_extension.py) and yields each bucket's (name, tensor) pairs, ready for
the model's `load_weights`. The plans (metadata only, rlsys/weights/buckets.py) reach the receivers by
Ray, the bytes by the transport:

  ObjectStoreTransfer  Ray's object store: CPU, any placement
  NCCLTransfer         a broadcast over a WeightGroup (NCCL between GPUs; gloo on CPU for tests)
  CudaIpcTransfer      colocated trainer and engine on one GPU: CUDA IPC handles, no copy on the wire

Every wait has a deadline and fails with WeightTransferTimeout naming the engine and the bucket.
In a run, rlsys/weights/sync.py picks the transport (`weights.transfer`) and drives both sides.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from rlsys.cluster import NotDone, get_each
from rlsys.weights.buckets import BucketPlan, unpack
from rlsys.weights.group import WeightGroup, WeightTransferTimeout

Weights = list[tuple[str, Tensor]]


@dataclass(frozen=True)
class WeightUpdate:
    """What an engine needs to receive one version of the weights: how it travels, its buckets' plans,
    and the sender's ticket (object refs for object_store, CUDA IPC handles by GPU for cuda_ipc, None for
    broadcast, whose bytes come in the collective)."""
    transfer: str  # weights.transfer
    plans: list[BucketPlan]
    ticket: Any
    timeout_s: float


class WeightTransfer(ABC):
    def __init__(self, engine: str, timeout_s: float = 600.0):
        self.engine, self.timeout_s = engine, timeout_s  # `engine` names this side (or the sending rank) in errors

    @abstractmethod
    def send(self, buckets: Iterable[tuple[BucketPlan, Tensor]]) -> Any:
        """Ship packed buckets; returns the ticket the receivers need (None if the data is in the collective)."""

    @abstractmethod
    def receive(self, plans: list[BucketPlan], ticket: Any, device: torch.device | str = "cpu") -> Iterator[Weights]:
        """Each bucket's (name, tensor) pairs, in order, on `device`."""

    def _what(self, plans: list[BucketPlan], index: int) -> str:
        return f"{self.engine}: {plans[index].describe(index)} of {len(plans)}"


class ObjectStoreTransfer(WeightTransfer):
    """One object per bucket: a receiver holds one bucket at a time, not a second copy of the model."""

    def send(self, buckets):
        import ray

        return [ray.put(flat.cpu()) for _, flat in buckets]

    def receive(self, plans, ticket, device="cpu"):
        for plan, flat in self.fetch(plans, ticket):
            yield unpack(plan, flat.to(device))

    def fetch(self, plans: list[BucketPlan], ticket: list) -> Iterator[tuple[BucketPlan, Tensor]]:
        """Each bucket still packed (what vLLM's RPC carries), one at a time."""
        import ray

        if len(ticket) != len(plans):
            raise ValueError(f"{self.engine}: {len(ticket)} object refs for {len(plans)} buckets")
        for i, (plan, ref) in enumerate(zip(plans, ticket)):
            try:
                flat = ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise WeightTransferTimeout(f"{self._what(plans, i)}: not in the object store after "
                                            f"{self.timeout_s:g} s") from e
            yield plan, flat


class NCCLTransfer(WeightTransfer):
    """Trainer rank 0 broadcasts each bucket to every engine worker of the group at once."""

    def __init__(self, group: WeightGroup, engine: str):
        super().__init__(engine, group.timeout_s)
        self.group = group

    def send(self, buckets):
        for i, (plan, flat) in enumerate(buckets):
            self.group.broadcast(flat, f"trainer sending {plan.describe(i)}")
        return None

    def receive(self, plans, ticket=None, device="cpu"):
        for i, plan in enumerate(plans):
            flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
            self.group.broadcast(flat, self._what(plans, i))
            yield unpack(plan, flat)


class CudaIpcTransfer(WeightTransfer):
    """Colocated: the trainer shares each bucket's GPU buffer by CUDA IPC handle (keyed by GPU UUID, since
    processes may number their visible GPUs differently); the receiver copies it out. The sender keeps the
    buffers alive until `release()`, which the caller runs once every receiver has returned."""

    def __init__(self, engine: str, timeout_s: float = 600.0):
        super().__init__(engine, timeout_s)
        self.shared: list[Tensor] = []

    def send(self, buckets):
        from torch.multiprocessing.reductions import reduce_tensor

        handles = []
        for plan, flat in buckets:
            if not flat.is_cuda:
                raise ValueError(f"CUDA IPC needs GPU buffers: {plan.describe(len(handles))} is on {flat.device}")
            self.shared.append(flat)
            handles.append(reduce_tensor(flat))
        torch.cuda.synchronize()  # the buffers are written before any receiver reads them
        return {gpu_uuid(self.shared[0].device): handles} if handles else {}

    def receive(self, plans, ticket, device="cuda"):
        device = torch.device(device)
        mine = ticket.get(gpu_uuid(device))
        if mine is None:
            raise ValueError(f"{self.engine}: no CUDA IPC handles for its GPU {gpu_uuid(device)} (have "
                             f"{sorted(ticket)}): is the trainer rank that shares this GPU sending?")
        for i, (plan, (rebuild, args)) in enumerate(zip(plans, mine)):
            args = list(args)
            args[6] = device.index  # the storage's device, as this process numbers it
            try:
                flat = rebuild(*args).clone()  # a copy of our own: the sender may free its buffer after us
            except RuntimeError as e:
                raise RuntimeError(f"{self._what(plans, i)}: could not open the CUDA IPC handle: {e}") from e
            yield unpack(plan, flat)

    def release(self) -> None:
        self.shared = []
        torch.cuda.ipc_collect()


def gpu_uuid(device: torch.device | str) -> str:
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def make_transfer(kind: str, who: str, timeout_s: float, group: WeightGroup | None = None) -> WeightTransfer:
    """The transport `weights.transfer` names, for the sender or a receiver `who`."""
    if kind == "object_store":
        return ObjectStoreTransfer(who, timeout_s)
    if kind == "cuda_ipc":
        return CudaIpcTransfer(who, timeout_s)
    if kind != "broadcast":
        raise ValueError(f"weights.transfer: unknown transfer {kind!r} (object_store, broadcast or cuda_ipc)")
    if group is None:
        raise RuntimeError(f"{who}: weights.transfer=broadcast, but it has not joined the weight group")
    return NCCLTransfer(group, who)


def wait_for_engines(refs: dict[str, Any], timeout_s: float) -> list:
    """ray.get on each party's call (engines' receives, the trainer's send), in order, the first failure
    raised as soon as it happens (cluster.get_each); after `timeout_s`, WeightTransferTimeout names the
    parties that did not finish."""
    try:
        return get_each(list(refs.values()), timeout_s)
    except NotDone as e:
        late = [name for name, ref in refs.items() if ref in e.pending]
        raise WeightTransferTimeout(f"weight update: {', '.join(late)} did not finish within {timeout_s:g} s") from None
