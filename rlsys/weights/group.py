"""A process group of its own for weight updates: trainer rank 0 plus every engine worker.

Neither side can join the other's default group (the trainer's is DeepSpeed's, each engine's is vLLM's),
so the group is built directly from a TCP store that trainer rank 0 hosts: rank 0 is the trainer, ranks
1.. the engine workers. NCCL on GPUs; gloo runs the same code on CPU (tests). Every wait has a deadline
and fails with an error that says what was being waited for; after such an error the group is unusable
(a collective is left half done) and must be built again.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor


class WeightTransferTimeout(TimeoutError):
    pass


class WeightGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
                 timeout_s: float = 600.0, names: list[str] | None = None):
        """`names[r]` says who rank r is (rank 0 names the ranks that did not join)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"weight group rank {rank} is outside world_size {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight group backend must be nccl or gloo (got {backend!r})")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        where = f"weight group {host}:{port} (rank {rank} of {world_size}, {backend})"
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            store = dist.PrefixStore("rlsys-weights", store)
            store.set(f"joined/{rank}", "1")
            if rank == 0:
                _wait_for_members(store, world_size, timeout, names or [f"rank {r}" for r in range(world_size)],
                                  where)
            if backend == "gloo":
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout  # NCCL's watchdog aborts a collective stuck longer than this
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        except RuntimeError as e:  # the store's DistStoreError included
            raise WeightTransferTimeout(f"{where}: not every rank joined within {timeout_s:g} s "
                                        f"(is trainer rank 0 serving {host}:{port}, and did every engine "
                                        f"worker start?): {e}") from e

    def broadcast(self, tensor: Tensor, what: str) -> None:
        """Broadcast `tensor` from rank 0 (in place on the others); `what` names it in errors."""
        self.wait(self.start_broadcast(tensor), what)

    def start_broadcast(self, tensor: Tensor):
        """Start a broadcast from rank 0 and return at once; `wait` on what it returns before touching `tensor`."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.pg.broadcast([tensor], options), time.monotonic() + self.timeout_s

    def wait(self, started, what: str) -> None:
        work, deadline = started
        while not work.is_completed():  # polled, so a missing peer is an error here, not a hang
            if time.monotonic() > deadline:
                raise WeightTransferTimeout(f"{what}: not complete after {self.timeout_s:g} s (rank {self.rank} "
                                            f"of {self.world_size}; a peer never joined this broadcast)")
            time.sleep(0.0005)
        try:
            work.wait()
        except RuntimeError as e:  # the backend's own timeout or a peer's failure
            raise WeightTransferTimeout(f"{what}: failed on rank {self.rank} of {self.world_size}: {e}") from e


def _wait_for_members(store, world_size: int, timeout: timedelta, names: list[str], where: str) -> None:
    """Rank 0: every rank has reached the store, or WeightTransferTimeout naming those that have not."""
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:
        missing = [names[r] for r, key in enumerate(keys) if not store.check([key])]
        raise WeightTransferTimeout(f"{where}: not every rank joined within {timeout.total_seconds():g} s: "
                                    f"{', '.join(missing)} did not") from e
