"""DeepSpeed backend: one rank of a ZeRO 0-3 data-parallel trainer (NCCL on GPU, gloo on CPU).

Gradient accumulation is driven by hand: the step's micro-batch count varies, so the engine is told
which backward closes the step, and `step()` is called once. The process group comes from the
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK variables that the worker sets.

Checkpoints keep the optimizer state per parameter name (universal.py): the full fp32 tensors are
gathered one parameter at a time, so a run saved on N ranks resumes on M ranks or another ZeRO stage.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import deepspeed
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)

from rlsys.config import TrainerConfig
from rlsys.trainer import lora
from rlsys.trainer.backend import (TrainerBackend, enable_gradient_checkpointing, load_weights,
                                   named_tensors, trained_parameters)
from rlsys.trainer.batching import StepTotals
from rlsys.trainer.critic import Critic
from rlsys.trainer.ds_config import deepspeed_config
from rlsys.trainer.logprobs import Scoring
from rlsys.trainer.schedule import lr_scheduler
from rlsys.trainer.universal import FORMAT, PerParameterState, save_per_parameter

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state besides its step count
MASTER = "master"  # the fp32 master weights, kept apart from bf16 model weights
SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU op that init_distributed builds unless told it cannot


class DeepSpeedBackend(TrainerBackend):
    name = "deepspeed"

    def __init__(self, cfg: TrainerConfig, model_dir: str, scoring: Scoring, rank: int = 0, world_size: int = 1):
        accelerator = get_accelerator()
        super().__init__(cfg, model_dir, scoring, rank, world_size, accelerator.current_device_name())
        check_device_supports(cfg, accelerator)
        if accelerator.device_name() == "cpu":  # its shared-memory all-reduce serves DeepSpeed inference only:
            deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # not compiled (~40 s, a C++ compiler) nor loaded
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
        self.stage, self.ds_config = cfg.zero_stage, deepspeed_config(cfg, world_size)
        model = self._load_partitioned()
        if cfg.lora.enabled:  # ZeRO then partitions the adapters' gradients and optimizer state alone
            model = lora.add_adapters(model, cfg.lora)
        if cfg.offload_optimizer:  # DeepSpeed's own CPU Adam (compiled on first use) steps the offloaded state
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            self.optimizer = DeepSpeedCPUAdam(trained_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                              adamw_mode=True)
        else:  # a torch optimizer, so DeepSpeed neither compiles its CPU Adam nor needs a GPU one
            self.optimizer = torch.optim.AdamW(trained_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config)
        # On the torch optimizer, whose param groups DeepSpeed's wrappers step: not the engine's lr_scheduler,
        # which engine.step would move at every mini-batch rather than once per train step (schedule.py).
        self.scheduler = lr_scheduler(self.optimizer, cfg)
        self.engine.eval()  # no dropout (see load_model); gradients flow all the same
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.engine.module)
        self.model = self.engine
        # DeepSpeed wraps the optimizer (ZeRO 1-3, or bf16 at stage 0): the wrapper keeps the fp32 master
        # weights, skips non-finite steps and measures the gradient norm itself.
        self.wrapped = self.engine.optimizer is not self.optimizer
        self.reference = self._make_reference()

    def _load_partitioned(self) -> torch.nn.Module:
        """The model in the training dtype; at ZeRO-3 built and loaded partitioned (transformers' DeepSpeed
        integration runs from_pretrained inside zero.Init), so no rank ever holds it whole."""
        with zero3_construction(self.ds_config) if self.stage == 3 else nullcontext():
            return self._load_trained_model()

    def _frozen_initial_model(self) -> torch.nn.Module:
        if self.stage != 3:
            return super()._frozen_initial_model()
        reference = self._load_partitioned().requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=reference, config=self.ds_config)  # no optimizer: inference
        engine.eval()  # the engine's eval returns nothing
        return engine

    def _start_micro_batch(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def _backward(self, loss: torch.Tensor) -> None:
        # The loss is already this rank's share of the step's sum, and DeepSpeed averages gradients
        # over ranks: scale by world size so the average is that sum.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple[float, bool]:
        if not self.wrapped:
            # DeepSpeed's wrappers refuse non-finite gradients themselves; without one that is left to us. The
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

    def sum_over_ranks(self, stats: dict) -> dict:
        names = sorted(stats)  # every rank reports the same statistics
        summed = torch.tensor([float(stats[k]) for k in names], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(summed)
        return dict(zip(names, summed.tolist()))

    def _rescaled_optimizer_step(self, divisor: float) -> tuple[float, bool]:
        # Streamed parts never close the accumulation: an empty micro-batch does, so the engine reduces at
        # the boundary. Then ZeRO's step divides the gradients and their norm by its loss scale before
        # clipping (`unscale_and_clip_grads`): set to `divisor`, that is the division we need, exactly
        # where it belongs, whether gradients live in p.grad or in ZeRO's partitions.
        self.accumulate_gradients([], StepTotals(1, 1, 1))
        if self.stage == 0:  # reduced into p.grad at the boundary (bf16 too): divide there
            return super()._rescaled_optimizer_step(divisor)
        optimizer = self.engine.optimizer
        if optimizer.loss_scale != 1.0:
            raise ValueError(f"trainer.streamed needs a loss scale of 1 (got {optimizer.loss_scale}); "
                             "use trainer.streamed=false")
        optimizer.override_loss_scale(divisor)
        try:
            return self._optimizer_step()
        finally:
            optimizer.override_loss_scale(1.0)

    def _parameters_gathered(self, modifier_rank=None, model: torch.nn.Module | None = None):
        """Full parameters of `model` (the policy's by default) inside the block: a no-op below ZeRO-3, an
        all-gather at ZeRO-3."""
        params = list((model or self.engine.module).parameters())
        enabled = self.stage == 3
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=enabled)

    def _weights_of(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors(model):
            gather = self.stage == 3 and isinstance(t, torch.nn.Parameter)  # buffers are never partitioned
            with deepspeed.zero.GatheredParameters([t], enabled=gather):  # this parameter alone, while read
                yield name, t.detach()

    def _hf_model(self) -> torch.nn.Module:
        return self.engine.module

    @torch.no_grad()
    def _mix_into_reference(self, alpha: float) -> None:
        if self.stage != 3:
            return super()._mix_into_reference(alpha)
        # Partitioned: gather one pair at a time; rank 0 mixes and its result is partitioned back (as TRL's).
        pairs = zip(self._reference_module().parameters(), self.engine.module.parameters(), strict=True)
        for ref, param in pairs:
            with deepspeed.zero.GatheredParameters([param]), \
                    deepspeed.zero.GatheredParameters([ref], modifier_rank=0):
                if self.rank == 0:
                    ref.mul_(1.0 - alpha).add_(param.detach().to(ref.dtype), alpha=alpha)

    def _load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        reference = self._reference_module()
        with self._parameters_gathered(modifier_rank=0, model=reference):
            reference.load_state_dict(weights)

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with self._parameters_gathered(modifier_rank=0):
            load_weights(self.engine.module, weights, self.cfg.lora.enabled)
        if self.wrapped:  # DeepSpeed keeps its own fp32 master weights: copy the loaded weights in
            self.engine.optimizer.refresh_fp32_params()

    @contextmanager
    def _fp32_partitions_attached(self):
        """ZeRO-3 detaches its fp32 partitions from the torch optimizer between steps (DeepSpeed does
        the same around its own checkpoints): attach them so the optimizer's param groups list them."""
        if self.stage == 3:
            self.engine.optimizer._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            if self.stage == 3:
                self.engine.optimizer._clear_fp32_optimizer_param_groups()

    # --- optimizer state per parameter name ---------------------------------------------------------
    def _layout(self) -> dict:
        return dict(super()._layout(), zero_stage=self.stage, dtype=self.cfg.dtype, optimizer=FORMAT)

    def _check_layout(self, layout: dict, folder: Path) -> None:
        # World size, ZeRO stage and dtype may all change: the state is stored whole, per parameter.
        if layout.get("backend") != self.name:
            raise ValueError(f"{folder} was written by the {layout.get('backend')} backend: resume it with "
                             f"trainer.backend={layout.get('backend')}")
        if layout.get("optimizer") != FORMAT:
            raise ValueError(f"{folder} keeps its optimizer state per rank (an older rlsys): resume it with the "
                             "rlsys version that wrote it")

    def _trained_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer steps, by name (with trainer.lora the adapters alone)."""
        return {name: p for name, p in self.engine.module.named_parameters() if p.requires_grad}

    def _state_keys(self) -> list[str]:
        if not self.optimizer.state:  # no step taken yet: nothing but zeros to keep
            return []
        return list(MOMENTS) + ([MASTER] if self.cfg.dtype == "bf16" else [])

    def _step_count(self) -> float:
        state = next(iter(self.optimizer.state.values()), None)
        return float(state["step"]) if state else 0.0

    def _save_optimizer(self, folder: Path) -> None:
        params = self._trained_named_parameters()

        def full(name: str, key: str) -> torch.Tensor:  # a collective under ZeRO: every rank gathers
            param = params[name]
            if self.stage == 0:
                tensor = self._stage0_state(param, key)
            elif key == MASTER:
                tensor = safe_get_full_fp32_param(param)
            else:
                tensor = safe_get_full_optimizer_state(param, key)
            return tensor.reshape(getattr(param, "ds_shape", param.shape))

        save_per_parameter(folder, params, self._state_keys(), full, self.rank, self.world_size,
                           self._step_count())

    @torch.no_grad()  # stage 0 bf16 writes into the fp32 masters, leaves that require grad
    def _load_optimizer(self, folder: Path) -> None:
        params = self._trained_named_parameters()
        with PerParameterState(folder) as saved:
            saved.check_names(params)
            self._reset_optimizer_state(saved.step, zero=not saved.keys)
            for name, param in params.items():
                for key in saved.keys:
                    if key == MASTER and self.cfg.dtype != "bf16":  # fp32 weights were loaded as they are
                        continue
                    value = saved.get(name, key)
                    if self.stage == 0:
                        self._stage0_state(param, key).copy_(value.view_as(param))
                    elif self.stage == 3 and param.ds_numel % self.world_size:
                        self._set_padded_partition(param, value, None if key == MASTER else key)
                    elif key == MASTER:  # the bf16 weights just loaded are these, rounded
                        safe_set_full_fp32_param(param, value)
                    else:
                        safe_set_full_optimizer_state(param, value, key)

    def _set_padded_partition(self, param: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
        """This rank's ZeRO-3 partition of a parameter's fp32 master (key None) or optimizer state, from the full
        tensor, where the parameter's size does not split evenly over the ranks: the last partition is padded, and
        DeepSpeed's safe_set_full_* read past the tensor's end there (a critic's one-element head bias)."""
        optimizer = self.engine.optimizer
        partition, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
        start = partition.numel() * optimizer._get_param_partition_rank(param)
        mine = value.flatten()[start:start + partition.numel()]
        partition.data.zero_()
        partition.data[:mine.numel()].copy_(mine)

    def _stage0_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """A parameter's optimizer state without ZeRO. In fp32 the torch optimizer steps the parameter itself;
        in bf16 DeepSpeed's FP16_UnfusedOptimizer gives each parameter an fp32 master, which it steps."""
        if not self.wrapped:
            return self.optimizer.state[param][key]
        wrapper = self.engine.optimizer
        for params, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups):
            for p, master in zip(params, masters):
                if p is param:
                    return master if key == MASTER else self.optimizer.state[master][key]
        raise KeyError(f"a parameter of shape {tuple(param.shape)} is not in the bf16 optimizer's groups")

    def _reset_optimizer_state(self, step: float, zero: bool) -> None:
        """Give every tensor the optimizer steps a state (AdamW creates it lazily at the first step) with
        the saved step count; zero its moments when the checkpoint predates the first step."""
        as_tensor = isinstance(self.optimizer, torch.optim.AdamW)  # DeepSpeed's CPU Adam counts in an int
        with self._fp32_partitions_attached():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    state = self.optimizer.state[p]
                    if not state:
                        state.update({k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS})
                    elif zero:
                        for k in MOMENTS:
                            state[k].zero_()
                    state["step"] = torch.tensor(step, dtype=torch.float32) if as_tensor else int(step)
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO 1-2 and bf16 map each parameter onto its state after the first step
            link()


class DeepSpeedCritic(Critic, DeepSpeedBackend):
    """The critic (critic.py) as its own DeepSpeed engine, with the policy's ZeRO settings."""


@contextmanager
def zero3_construction(ds_config: dict):
    """Inside, transformers' from_pretrained builds the model under deepspeed.zero.Init with `ds_config`
    and loads each weight into its partitions."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference: keep it alive here
    try:
        yield hf_config
    finally:
        unset_hf_deepspeed_config()


def check_device_supports(cfg: TrainerConfig, accelerator) -> None:
    """Refuse what this rank's device cannot run before any process group starts."""
    on_cpu = accelerator.device_name() == "cpu"
    for field in ("offload_optimizer", "offload_params"):
        if getattr(cfg, field) and on_cpu:
            raise ValueError(f"trainer.{field}=true needs a CUDA GPU (this rank runs on the CPU, "
                             "where everything already lives in CPU memory)")
    if cfg.dtype == "bf16" and not accelerator.is_bf16_supported():
        raise ValueError(f"trainer.dtype=bf16: the {accelerator.device_name()} device of this rank has no bf16; "
                         "use trainer.dtype=float32")
