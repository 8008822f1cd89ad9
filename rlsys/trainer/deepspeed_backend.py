"""DeepSpeed backend: one rank of a ZeRO 0-3 data-parallel trainer (NCCL on GPU, gloo on CPU).

Gradient accumulation is driven by hand: the step's micro-batch count varies, so the engine is told
which backward closes the step, and `step()` is called once. The process group comes from the
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK variables that the worker sets.
"""
from __future__ import annotations

from contextlib import contextmanager

import deepspeed
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from rlsys.config import TrainerConfig
from rlsys.trainer.backend import TrainerBackend, load_model


def deepspeed_config(cfg: TrainerConfig, world_size: int) -> dict:
    return {
        # Nominal sizes: batches are token-packed and accumulation is set per step (see the module doc).
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": cfg.grad_clip,
        # ZeRO 1-3 skip a step whose gradient norm is not finite; in fp32 that norm is the only check.
        "zero_optimization": {"stage": cfg.zero_stage, "compute_grad_norm": True},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend(TrainerBackend):
    name = "deepspeed"

    def __init__(self, cfg: TrainerConfig, model_dir: str, rank: int = 0, world_size: int = 1):
        accelerator = get_accelerator()
        super().__init__(cfg, model_dir, rank, world_size, accelerator.current_device_name())
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
        model = load_model(model_dir, self.device)
        # A torch optimizer, so DeepSpeed neither compiles its CPU Adam nor needs a GPU one.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                               config=deepspeed_config(cfg, world_size))
        self.engine.eval()  # no dropout (see load_model); gradients flow all the same
        self.model = self.engine
        self.stage = cfg.zero_stage

    def _start_micro_batch(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def _backward(self, loss: torch.Tensor) -> None:
        # The loss is already this rank's share of the step's sum, and DeepSpeed averages gradients
        # over ranks: scale by world size so the average is that sum.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple[float, bool]:
        if self.stage == 0:
            # ZeRO 1-3 refuse non-finite gradients themselves; without ZeRO that is left to us. The
            # gradients are already averaged, so every rank reaches the same verdict.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            if not np.isfinite(norm):
                self.engine.zero_grad()
                return norm, False
            self.engine.step()
            return norm, True
        self.engine.step()
        return float(self.engine.get_global_grad_norm()), self.engine.was_step_applied()

    def _parameters_gathered(self, modifier_rank=None):
        """Full parameters inside the block: a no-op below ZeRO-3, an all-gather at ZeRO-3."""
        params = list(self.engine.module.parameters())
        enabled = self.stage == 3
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=enabled)

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        with self._parameters_gathered():
            return {k: v.detach().to("cpu", torch.float32).clone()
                    for k, v in self.engine.module.state_dict().items()}

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with self._parameters_gathered(modifier_rank=0):
            self.engine.module.load_state_dict(weights)
        if self.stage > 0:  # ZeRO keeps its own fp32 master partitions: copy the loaded weights in
            self.engine.optimizer.refresh_fp32_params()

    def _optimizer_is_partitioned(self) -> bool:
        return self.stage > 0

    @contextmanager
    def _fp32_partitions_attached(self):
        """ZeRO-3 detaches its fp32 partitions from the torch optimizer between steps (DeepSpeed does
        the same around its own checkpoints): attach them so the optimizer's state dict can map them."""
        if self.stage == 3:
            self.engine.optimizer._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            if self.stage == 3:
                self.engine.optimizer._clear_fp32_optimizer_param_groups()

    def _optimizer_state(self) -> dict:
        with self._fp32_partitions_attached():
            return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict) -> None:
        with self._fp32_partitions_attached():
            self.optimizer.load_state_dict(state)

    def _layout(self) -> dict:
        return dict(super()._layout(), zero_stage=self.stage)
