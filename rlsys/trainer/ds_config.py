"""The DeepSpeed config dict for a TrainerConfig: a pure function, so tests check it without DeepSpeed or CUDA."""
from __future__ import annotations

from rlsys.config import TrainerConfig


def deepspeed_config(cfg: TrainerConfig, world_size: int) -> dict:
    # Only keys every DeepSpeed of pyproject.toml's range accepts (its configs refuse unknown keys): no
    # compute_grad_norm, which 0.19 added and defaults to on, as older versions always compute the norm.
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:  # fp32 master weights, Adam moments and the optimizer step on the CPU
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        # Nominal sizes: batches are token-packed and accumulation is set per step (deepspeed_backend.py).
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": cfg.grad_clip,
        # bf16 weights and gradients; the ZeRO optimizer keeps fp32 master weights and moments.
        "bf16": {"enabled": cfg.dtype == "bf16"},
        # ZeRO 1-3 skip a step whose gradient norm is not finite; in fp32 that norm is the only check.
        "zero_optimization": zero,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
