"""Weight updates inside vLLM's GPU workers: methods vLLM mixes into each worker class
(EngineArgs.worker_extension_cls), reached from the engine with `collective_rpc("rlsys_...")`.

Every tensor-parallel worker receives the full Hugging Face-named tensors and hands them to the model's
own `load_weights`, which keeps this worker's shard (and fuses q/k/v, gate/up) the way vLLM loads a
checkpoint. The worker provides `self.model_runner`, `self.device` and `self.rank` (its rank within the
engine). Nothing here imports vLLM, so the module also imports where vLLM is missing.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from rlsys.weights.buckets import BucketPlan, unpack
from rlsys.weights.group import WeightGroup
from rlsys.weights.transfer import CudaIpcTransfer, NCCLTransfer, Weights

EXTENSION = "rlsys.rollout.vllm_extension.WeightUpdateExtension"  # the path vLLM imports in each worker


class WeightUpdateExtension:
    def rlsys_load_bucket(self, plan: BucketPlan, flat: Tensor) -> int:
        """Load one packed bucket sent with the RPC itself (the object-store path)."""
        return self._rlsys_load(unpack(plan, flat.to(self.device, non_blocking=True)))

    def rlsys_init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int,
                                backend: str = "nccl", timeout_s: float = 600.0) -> int:
        """Join the weight group (trainer rank 0 hosts it at host:port); this worker is rank_offset + rank.
        Blocks until every member has joined, so the trainer and all engines must call it together."""
        torch.cuda.set_device(self.device)
        self._rlsys_group = WeightGroup(host, port, rank_offset + self.rank, world_size, backend, timeout_s)
        return self._rlsys_group.rank

    def rlsys_receive_broadcast(self, plans: list[BucketPlan], engine: str) -> int:
        """Receive every bucket from trainer rank 0's broadcast and load it, one bucket at a time."""
        group = getattr(self, "_rlsys_group", None)
        if group is None:
            raise RuntimeError(f"{engine} worker {self.rank}: no weight group (call rlsys_init_weight_group first)")
        transfer = NCCLTransfer(group, f"{engine} worker {self.rank}")
        return self._rlsys_load_all(transfer.receive(plans, device=self.device))

    def rlsys_receive_ipc(self, plans: list[BucketPlan], handles: dict, engine: str) -> int:
        """Colocated: open the trainer's CUDA IPC handles for this worker's GPU, copy and load each bucket."""
        transfer = CudaIpcTransfer(f"{engine} worker {self.rank}")
        return self._rlsys_load_all(transfer.receive(plans, handles, self.device))

    def _rlsys_load_all(self, buckets: Iterable[Weights]) -> int:
        loaded = sum(self._rlsys_load(weights) for weights in buckets)
        torch.cuda.synchronize(self.device)
        return loaded

    def _rlsys_load(self, weights: Weights) -> int:
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)
