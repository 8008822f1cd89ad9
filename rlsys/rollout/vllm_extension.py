"""Weight updates inside vLLM's GPU workers: methods vLLM mixes into each worker class
(EngineArgs.worker_extension_cls), reached from the engine with `collective_rpc("rlsys_...")`.

Checked against the source of vLLM 0.33.0 (release commit 4ba787ec9); paths are inside the vLLM repository.
vLLM imports the class by its qualified name in every worker process and appends it to the worker class's
bases, refusing any name the worker already has (vllm/config/parallel.py worker_extension_cls,
vllm/v1/worker/worker_base.py `WorkerWrapperBase.init_worker`): hence the rlsys_ prefix. A string
method name in `collective_rpc` is looked up on the worker (vllm/v1/serial_utils.py `run_method`).

Every tensor-parallel worker receives the full Hugging Face-named tensors and hands them to the model's
own `load_weights` (an iterable of (name, tensor), e.g. vllm/model_executor/models/qwen2.py through
`AutoWeightsLoader` in vllm/model_executor/models/utils.py), which keeps this worker's shard and fuses
q/k/v and gate/up the way vLLM loads a checkpoint. From the worker: `self.rank` (its rank in the
engine) and `self.device` (vllm/v1/worker/worker_base.py `WorkerBase`, set in
vllm/v1/worker/gpu_worker.py `init_device`), `self.vllm_config`, and `self.model_runner.get_model()`,
which unwraps the CUDA graph wrapper (vllm/v1/worker/gpu_model_runner.py; the V2 runner in
vllm/v1/worker/gpu/model_runner.py has it too). Loading runs under the worker's config, as vLLM's own
`update_weights` and `reload_weights` do (gpu_worker.py).

Only unquantized weights: vLLM's own transfer engines (vllm/distributed/weight_transfer/) wrap
`load_weights` in a layer-wise reload that reruns weight post-processing, which quantized layers need;
for unquantized layers on CUDA that processing does nothing (vllm/model_executor/layers/linear.py
`UnquantizedLinearMethod.process_weights_after_loading`), so a plain `load_weights` suffices.

vLLM is imported only inside the methods, which run only in its workers, so this module imports anywhere.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from rlsys.weights.buckets import BucketPlan, unpack
from rlsys.weights.group import WeightGroup
from rlsys.weights.transfer import Weights, WeightUpdate

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

    def rlsys_receive(self, update: WeightUpdate, engine: str) -> int:
        """Receive every bucket of `update` by its own receiver (broadcast: from trainer rank 0 over the
        weight group; cuda_ipc: from the trainer rank on this worker's GPU) and load it, one at a time."""
        who = f"{engine} worker {self.rank}"
        return self._rlsys_load_all(update.buckets(who, self.device, getattr(self, "_rlsys_group", None)))

    def _rlsys_load_all(self, buckets: Iterable[Weights]) -> int:
        loaded = sum(self._rlsys_load(weights) for weights in buckets)
        torch.cuda.synchronize(self.device)
        return loaded

    def _rlsys_load(self, weights: Weights) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights)
        return len(weights)
