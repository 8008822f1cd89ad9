"""How a version of the weights travels from the trainer to the engines' workers, bucket by bucket.

A `Transport` is chosen once per run from `weights.transfer` (`make_transport`, the one place that reads
it). It opens a `Sender` on each sending trainer rank and gives the engines a `Receiver`: a small picklable
description that carries its own receiving logic, so an engine only ever "loads this WeightUpdate".

Sending streams: the trainer reads its parameters one at a time (rlsys/trainer/backend.py
`rollout_weights`), each cast on its own device straight into a bucket buffer (buckets.py `fill_buckets`),
and a sender owns at most two buffers, reused for every bucket and version. Never a copy of the whole model:

  object_store  one buffer on the CPU; each bucket is put in Ray's object store (a copy there, which a
                replaced rollout worker loads too), then the engines fetch them one at a time.
  broadcast     two buffers: bucket i is broadcast over a WeightGroup (NCCL between GPUs, gloo on CPU)
                while bucket i + 1 is packed; the engines receive as the trainer sends.
  cuda_ipc      two GPU buffers shared once by CUDA IPC handle with the engine on the same GPU; per bucket a
                handshake through a TCP store the trainer rank hosts: "ready i" from the trainer, "done i"
                from the engine once loaded, before bucket i + 2 may overwrite that buffer.

Every wait has a deadline and fails with WeightTransferTimeout naming the engine and the bucket.
rlsys/weights/sync.py drives both sides in a run.
"""
from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from rlsys.cluster import NotDone, get_each
from rlsys.weights.buckets import BucketPlan, fill_buckets, unpack
from rlsys.weights.group import WeightGroup, WeightTransferTimeout

Weights = list[tuple[str, Tensor]]
Named = Iterable[tuple[str, Tensor]]  # a trainer's parameters, read one at a time


def _what(who: str, plans: list[BucketPlan], index: int) -> str:
    return f"{who}: {plans[index].describe(index)} of {len(plans)}"


def _buffers(plans: list[BucketPlan], count: int, device, have: list[Tensor]) -> list[Tensor]:
    """`count` uint8 buffers as large as the largest bucket: the ones we have if they are large enough."""
    size = max(p.nbytes for p in plans)
    if len(have) == count and have[0].numel() >= size and have[0].device == torch.device(device):
        return have
    have.clear()  # freed before the larger ones are made
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]


# --- receivers: what an engine is given, picklable --------------------------------------------------
class Receiver(ABC):
    """The engine side of a transport. `per_worker`: every process holding weights (each vLLM
    tensor-parallel worker) receives by itself; otherwise the engine's process receives once."""
    per_worker = True

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    @abstractmethod
    def packed(self, plans: list[BucketPlan], version: int, who: str, device, group: WeightGroup | None
               ) -> Iterator[tuple[BucketPlan, Tensor]]:
        """Each bucket, still packed, in order; a bucket's buffer may be reused once the next is asked for."""


class ObjectStoreReceiver(Receiver):
    per_worker = False  # vLLM's worker processes are not Ray workers: the engine fetches, the RPC carries

    def __init__(self, refs: list, timeout_s: float):
        super().__init__(timeout_s)
        self.refs = refs

    def packed(self, plans, version, who, device, group=None):
        import ray

        if len(self.refs) != len(plans):
            raise ValueError(f"{who}: {len(self.refs)} object refs for {len(plans)} buckets")
        for i, (plan, ref) in enumerate(zip(plans, self.refs)):
            try:
                array = ray.get(ref, timeout=self.timeout_s)  # read-only, in the store: copied out once
            except ray.exceptions.GetTimeoutError as e:
                raise WeightTransferTimeout(f"{_what(who, plans, i)}: not in the object store after "
                                            f"{self.timeout_s:g} s") from e
            yield plan, torch.tensor(array, device=device)


class BroadcastReceiver(Receiver):
    def packed(self, plans, version, who, device, group=None):
        if group is None:
            raise RuntimeError(f"{who}: weights.transfer=broadcast, but it has not joined the weight group")
        for i, plan in enumerate(plans):
            flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
            group.broadcast(flat, _what(who, plans, i))
            yield plan, flat


class CudaIpcReceiver(Receiver):
    def __init__(self, stores: dict[str, tuple[str, int]], timeout_s: float):
        super().__init__(timeout_s)
        self.stores = stores  # GPU UUID -> the TCP store of the trainer rank on that GPU

    def packed(self, plans, version, who, device, group=None):
        device = torch.device(device)
        uuid = gpu_uuid(device)
        if uuid not in self.stores:
            raise ValueError(f"{who}: no trainer rank shares its GPU {uuid} (have {sorted(self.stores)})")
        host, port = self.stores[uuid]
        store = open_store(host, port, False, self.timeout_s)
        buffers = [open_shared(h, device) for h in pickle.loads(wait_key(store, "handles", self.timeout_s, who))]
        for i, plan in enumerate(plans):
            wait_key(store, f"{version}/ready/{i}", self.timeout_s, _what(who, plans, i))
            yield plan, buffers[i % len(buffers)][:plan.nbytes]
            torch.cuda.synchronize(device)  # loaded: the trainer may overwrite this buffer
            store.set(f"{version}/done/{i}", "1")


# --- senders: one per sending trainer rank, kept for the run -----------------------------------------
class Sender(ABC):
    buffer_count = 2
    device = "cpu"

    def __init__(self, who: str, timeout_s: float):
        self.who, self.timeout_s = who, timeout_s
        self.buffers: list[Tensor] = []

    def send(self, plans: list[BucketPlan], weights: Named, version: int) -> Receiver | None:
        """Pack and ship every bucket as its parameters come; returns the receivers' description when only
        the sent version makes it (object_store's refs), else None (the one from `address` holds)."""
        self.buffers = _buffers(plans, self.buffer_count, self.device, self.buffers)
        self._begin(version)
        for i, plan, flat in fill_buckets(plans, weights, self.buffers, lambda i: self._reuse(version, i)):
            self._ship(version, i, plan, flat)
        return self._end(version, len(plans))

    def address(self) -> Any:
        """What the receivers need to find this sender, sent to them once."""
        return None

    def _begin(self, version: int) -> None:
        pass

    def _reuse(self, version: int, index: int) -> None:
        """Wait until the receivers are done with the bucket that last used bucket `index`'s buffer."""

    @abstractmethod
    def _ship(self, version: int, index: int, plan: BucketPlan, flat: Tensor) -> None: ...

    @abstractmethod
    def _end(self, version: int, count: int) -> Receiver | None: ...


class ObjectStoreSender(Sender):
    buffer_count = 1  # ray.put has copied a bucket out before the next is packed

    def _begin(self, version):
        self.refs = []

    def _ship(self, version, index, plan, flat):
        import ray

        self.refs.append(ray.put(flat.numpy()))  # an array: only the bucket's bytes, not the whole buffer

    def _end(self, version, count):
        return ObjectStoreReceiver(self.refs, self.timeout_s)


class BroadcastSender(Sender):
    def __init__(self, who, timeout_s, group: WeightGroup, device: str):
        super().__init__(who, timeout_s)
        self.group, self.device = group, device
        self.pending: dict[int, Any] = {}  # bucket index -> its broadcast, until done

    def _reuse(self, version, index):
        self._wait(index - self.buffer_count)

    def _ship(self, version, index, plan, flat):
        self.pending[index] = (self.group.start_broadcast(flat), f"{self.who} sending {plan.describe(index)}")

    def _end(self, version, count):
        for index in sorted(self.pending):
            self._wait(index)
        return None

    def _wait(self, index: int) -> None:
        if index in self.pending:
            self.group.wait(*self.pending.pop(index))


class CudaIpcSender(Sender):
    device = "cuda"

    def __init__(self, who, timeout_s, host: str):
        super().__init__(who, timeout_s)
        self.host = host
        self.store = open_store(host, 0, True, timeout_s)  # port 0: the system picks a free one
        self.shared: list[Tensor] = []  # the buffers whose handles the receivers hold

    def address(self):
        return gpu_uuid(torch.device("cuda", torch.cuda.current_device())), (self.host, self.store.port)

    def _begin(self, version):
        if self.shared is not self.buffers:  # new (larger) buffers: hand out their handles
            from torch.multiprocessing.reductions import reduce_tensor

            self.store.set("handles", pickle.dumps([reduce_tensor(b) for b in self.buffers]))
            self.shared = self.buffers

    def _reuse(self, version, index):
        self._wait_done(version, index - self.buffer_count)

    def _ship(self, version, index, plan, flat):
        torch.cuda.synchronize()  # the bucket is written before the receiver reads it
        self.store.set(f"{version}/ready/{index}", "1")

    def _end(self, version, count):
        for index in range(max(0, count - self.buffer_count), count):
            self._wait_done(version, index)
        return None

    def _wait_done(self, version: int, index: int) -> None:
        if index >= 0:
            wait_key(self.store, f"{version}/done/{index}", self.timeout_s,
                     f"{self.who}: the engine on its GPU did not load bucket {index}")
            self.store.delete_key(f"{version}/ready/{index}")
            self.store.delete_key(f"{version}/done/{index}")


# --- transports: chosen once per run ------------------------------------------------------------------
@dataclass(frozen=True)
class Transport(ABC):
    """One kind of transport as a run uses it; picklable, so the trainer ranks open their senders from it."""
    timeout_s: float
    on_gpus: bool = False  # the trainer packs on its GPU, the engines receive on theirs
    name = ""  # weights.transfer, for messages
    streams = True  # the engines receive while the trainer sends (else after it has sent)
    restartable = False  # a replaced rollout worker can load the last version
    from_every_gpu = False  # every trainer rank on an engine's GPU sends; else trainer rank 0 alone

    @property
    def group_backend(self) -> str | None:
        """The weight group it needs ("nccl" or "gloo"), or None."""
        return None

    @abstractmethod
    def sender(self, who: str, group: WeightGroup | None = None, host: str = "") -> Sender: ...

    def receiver(self, addresses: list) -> Receiver | None:
        """The receivers' description from the senders' addresses; None where each version makes its own."""
        return None


class ObjectStoreTransport(Transport):
    name, streams, restartable = "object_store", False, True  # its buckets stay in the store for a replacement

    def sender(self, who, group=None, host=""):
        return ObjectStoreSender(who, self.timeout_s)


class BroadcastTransport(Transport):
    name = "broadcast"

    @property
    def group_backend(self):
        return "nccl" if self.on_gpus else "gloo"

    def sender(self, who, group=None, host=""):
        if group is None:
            raise RuntimeError(f"{who}: weights.transfer=broadcast, but it has not joined the weight group")
        return BroadcastSender(who, self.timeout_s, group, "cuda" if self.on_gpus else "cpu")

    def receiver(self, addresses):
        return BroadcastReceiver(self.timeout_s)


class CudaIpcTransport(Transport):
    name, from_every_gpu = "cuda_ipc", True

    def sender(self, who, group=None, host=""):
        return CudaIpcSender(who, self.timeout_s, host)

    def receiver(self, addresses):
        return CudaIpcReceiver(dict(a for a in addresses if a is not None), self.timeout_s)


TRANSPORTS = {t.name: t for t in (ObjectStoreTransport, BroadcastTransport, CudaIpcTransport)}


def make_transport(weights_cfg, engine_on_gpu: bool) -> Transport:
    """The transport `weights.transfer` names: the one place that reads it."""
    kind = TRANSPORTS.get(weights_cfg.transfer)
    if kind is None:
        raise ValueError(f"weights.transfer: unknown transfer {weights_cfg.transfer!r} ({', '.join(TRANSPORTS)})")
    return kind(weights_cfg.timeout_s, engine_on_gpu or kind is CudaIpcTransport)


@dataclass(frozen=True)
class WeightUpdate:
    """One version of the weights on its way to an engine: load it with `buckets`."""
    version: int
    plans: list[BucketPlan]
    receiver: Receiver

    def packed(self, who: str, device="cpu", group: WeightGroup | None = None) -> Iterator[tuple[BucketPlan, Tensor]]:
        return self.receiver.packed(self.plans, self.version, who, device, group)

    def buckets(self, who: str, device="cpu", group: WeightGroup | None = None) -> Iterator[Weights]:
        """Each bucket's (name, tensor) pairs, in order, on `device`: load one before asking for the next."""
        for plan, flat in self.packed(who, device, group):
            yield unpack(plan, flat)


# --- helpers --------------------------------------------------------------------------------------
def gpu_uuid(device: torch.device | str) -> str:
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def open_shared(handle, device: torch.device) -> Tensor:
    """A CUDA IPC handle (torch's reduce_tensor) opened on this process's numbering of its GPU."""
    rebuild, args = handle
    args = list(args)
    # the storage's device as this process numbers it: an int, as torch's _new_shared_cuda requires
    args[6] = torch.cuda.current_device() if device.index is None else device.index
    return rebuild(*args)


def open_store(host: str, port: int, master: bool, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def wait_key(store, key: str, timeout_s: float, what: str) -> bytes:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # the store's DistStoreError included
        raise WeightTransferTimeout(f"{what}: no {key!r} after {timeout_s:g} s") from e
    return store.get(key)


def wait_for_engines(refs: dict[str, Any], timeout_s: float) -> list:
    """ray.get on each party's call (engines' receives, the trainer's send), in order, the first failure
    raised as soon as it happens (cluster.get_each); after `timeout_s`, WeightTransferTimeout names the
    parties that did not finish."""
    try:
        return get_each(list(refs.values()), timeout_s)
    except NotDone as e:
        late = [name for name, ref in refs.items() if ref in e.pending]
        raise WeightTransferTimeout(f"weight update: {', '.join(late)} did not finish within {timeout_s:g} s") from None
