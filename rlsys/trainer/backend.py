"""Trainer backends. The micro-batch loop and the loss are shared here; a backend owns the model, the
optimizer step, and how weights and optimizer state reach files. `TorchBackend` is plain torch AdamW
in one process; `DeepSpeedBackend` (deepspeed_backend.py) adds ZeRO and data parallelism.

Checkpoint folder written by `save` (safetensors + JSON only, nothing pickled):
  model.safetensors                      full weights, HF names (rank 0)
  optimizer_rank0.safetensors/.json      torch backend: the optimizer's state dict
  optimizer.json, optimizer_shard{r}.safetensors   DeepSpeed: state per parameter name (universal.py),
                                         so a run resumes on another world size or ZeRO stage
  state_rank{r}.safetensors/.json        RNG states and step counters of each rank (the LR schedule's too)
  trainer.json                           the layout it was written with, checked on load
  reference.safetensors                  with trainer.kl.ref_sync_steps: the refreshed reference (rank 0)
With trainer.lora, adapter.safetensors (the adapters, peft's names) stands in for model.safetensors: the base
weights are the model's own, never changed.
"""
from __future__ import annotations

import json
import random
import time
import warnings
from abc import ABC, abstractmethod
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rlsys import costs
from rlsys.config import TrainerConfig
from rlsys.emulate import TrainerPacer
from rlsys.trainer import lora
from rlsys.trainer.batching import MicroBatch, StepTotals, TrainSample, collate, pack_micro_batches
from rlsys.trainer.logprobs import Scoring, head_logprobs
from rlsys.trainer.schedule import lr_scheduler
from rlsys.trainer.losses import (LOSS_STATS, REJECTED_SHARE, LossInputs, compute_loss, kept_share, kl_penalty,
                                 loglinear_proximal)
from rlsys.trainer.tensor_io import load_state, save_state, save_tensors

LAYOUT_FILE = "trainer.json"
ADAPTER_FILE = "adapter.safetensors"  # trainer.lora: the adapters, in place of model.safetensors
ADAPTER_EXPORT = "adapter"  # trainer.lora: the export's subfolder with the adapters in peft's format
REFERENCE_FILE = "reference.safetensors"  # trainer.kl.ref_sync_steps: the refreshed reference, HF names (rank 0)


DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}  # trainer.dtype -> the weights' dtype


def load_model(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model in `dtype`, on the CPU (or partitioned as it is built, inside DeepSpeed's ZeRO-3 context)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
    model.eval()  # no dropout, ever: training log-probs must match the engine's
    return model


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter, or with trainer.lora the adapters alone."""
    return [p for p in model.parameters() if p.requires_grad]


def scored_forward(model: torch.nn.Module, mb: MicroBatch, scoring: Scoring,
                   chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of each next token, [B, L-1], from one forward of `model` (an HF causal LM, or a
    DeepSpeed engine around one). For this forward its LM head scores the tokens chunk by chunk instead of
    returning logits (logprobs.py), so the full logits never exist; the head is still called as a module,
    so ZeRO-3 gathers its weight as for any layer."""
    head = getattr(model, "module", model).get_output_embeddings()
    head.forward = lambda hidden: head_logprobs(hidden, head, mb.input_ids, scoring, chunk)
    try:
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    finally:
        del head.forward  # the class's forward again


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward. HF checkpoints a layer only while it is in
    training mode, so the layers alone are flagged as training: their submodules stay in eval (no dropout)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def cpu_copy(weights: Iterator[tuple[str, torch.Tensor]], keep: bool = True) -> dict[str, torch.Tensor]:
    """Each tensor copied to CPU float32, read one at a time; every rank reads them all (ZeRO-3 gathers each, a
    collective), and only with `keep` does it hold the copies."""
    return {name: t.to("cpu", torch.float32, copy=True) for name, t in weights if keep}


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What model.state_dict() holds, in its order (tied weights under each name), read one at a time."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                yield dot + name, p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield dot + name, b


def local_device() -> str:
    """This process's GPU where it has one (Ray narrows CUDA_VISIBLE_DEVICES to the actor's), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def write_hf_model(weights: dict[str, torch.Tensor], config_dir: str, out_dir: str | Path) -> None:
    """A standard HF model folder (config, generation config, safetensors) from HF-named weights."""
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):  # the weights come from `weights`: no second copy is allocated
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(weights, assign=True, strict=True)
    model.tie_weights()
    if (Path(config_dir) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    model.save_pretrained(str(out_dir))


def proximal_source(cfg: TrainerConfig, fresh: bool, version: int | None) -> str:
    """Where a step's PPO mini-batches after the first, on weights that have moved, take pi_prox (the policy of
    the weights that started the step, at `version`; None: not known). `fresh`: every token was sampled by
    those weights. "behaviour": the engine's log-probs are pi_prox, for the first mini-batch too; not under a
    mismatch correction, which needs the trainer's own pi_old. "loglinear": interpolated from each mini-batch's
    own forward (trainer.proximal=loglinear). "recompute": a forward on the starting weights."""
    if fresh and not cfg.mismatch.active:
        return "behaviour"
    return "loglinear" if cfg.proximal == "loglinear" and version is not None else "recompute"


class TrainerBackend(ABC):
    """One rank's trainer. Subclasses set `model` (what forward runs through) and `optimizer` (torch). Every
    forward scores tokens by `scoring`, the run's (logprobs.py)."""

    name = "base"
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # trainer.lr_schedule on `optimizer` (schedule.py)
    pacer: TrainerPacer | None = None  # emulate: each micro-batch held until its modelled time

    def __init__(self, cfg: TrainerConfig, model_dir: str, scoring: Scoring, rank: int = 0, world_size: int = 1,
                 device="cpu"):
        self.cfg, self.model_dir, self.scoring = cfg, model_dir, scoring
        self.rank, self.world_size, self.device = rank, world_size, device
        self.skipped_steps = 0
        self.updates = 0  # optimizer steps taken (or skipped): trainer.kl.ref_sync_steps counts them
        seed_everything(cfg.seed)
        self.reference: torch.nn.Module | None = None  # set by the subclass: `_make_reference`

    # --- the shared loop ----------------------------------------------------------------------
    def compute_logprobs(self, samples: list[TrainSample], micro_batches: int = 0, model=None) -> list[list[float]]:
        """Log-probs of each sample's response tokens under the current weights (or `model`), in input order."""
        found: dict[int, list[float]] = {}
        with torch.no_grad():
            for batch in self._micro_batches(samples, micro_batches):
                started = time.perf_counter()
                mb = collate(batch).to(self.device)
                logprobs, _ = self._score(model or self.model, mb)
                self._pace(started, batch, costs.FORWARD_FLOPS)
                for row, sample in enumerate(batch):
                    found[id(sample)] = logprobs[row, sample.prompt_len - 1:sample.num_tokens - 1].tolist()
        return [found[id(s)] for s in samples]

    def token_kl(self, samples: list[TrainSample], micro_batches: int) -> list[list[float]]:
        """Each sample's KL to the reference per response token, trainer.kl.estimator, from its behaviour log-probs
        (trainer.kl.in_reward; every rank runs `micro_batches` reference forwards)."""
        reference = self.compute_logprobs(samples, micro_batches, self.reference)
        return [(kl_penalty(torch.tensor(s.logprobs), torch.tensor(ref), self.cfg.kl.estimator)
                 * (1.0 if s.mask is None else torch.tensor(s.mask))).tolist()  # a tool's tokens: no KL
                for s, ref in zip(samples, reference)]

    def sequence_kl(self, samples: list[TrainSample], micro_batches: int) -> list[float]:
        """`token_kl` summed over each sample's response tokens."""
        return [sum(kl) for kl in self.token_kl(samples, micro_batches)]

    def train_step(self, samples: list[TrainSample], totals: StepTotals, interpolate_at: int | None = None,
                   at_start: bool = True) -> dict:
        """Accumulate gradients over this rank's micro-batches, then take exactly one optimizer step.
        `at_start`: the weights are those that started the step (not a later PPO mini-batch's).

        Returned statistics are this rank's shares of the step's values (sum them over ranks);
        `grad_norm` and `skipped_steps` are the same on every rank.
        """
        if totals.micro_batches == 0:  # no response tokens anywhere: nothing to step on
            return self.skip_step()
        rejecting = self.cfg.mismatch.reject is not None  # then the step's gradient is divided once closed
        stats = self.accumulate_gradients(samples, totals, closes_step=not rejecting, interpolate_at=interpolate_at,
                                          at_start=at_start)
        stats, kept = self.divide_by_kept(stats)
        return self.close_step(stats, sum(s.trained_tokens for s in samples), len(samples), divisor=kept)

    def divide_by_kept(self, stats: dict) -> tuple[dict, float | None]:
        """With trainer.mismatch.reject, the step's statistics (this rank's shares of its planned counts) with the
        loss divided by the share of the normaliser that rejection kept on every rank (`kept_share`), as veRL's
        rejection divides by the kept counts, and that share: what the step's gradient is divided by too.
        Without, the statistics as they are and None."""
        if self.cfg.mismatch.reject is None:
            return stats, None
        kept = kept_share(self.sum_over_ranks({k: stats.get(k, 0.0) for k in REJECTED_SHARE.values()}), self.cfg)
        return {k: v / kept if k in LOSS_STATS else v for k, v in stats.items()}, kept

    def sum_over_ranks(self, stats: dict) -> dict:
        """These statistics summed over every rank (one rank here; DeepSpeed all-reduces)."""
        return stats

    def skip_step(self) -> dict:
        """A step with no response tokens on any rank: no update, counted as skipped."""
        self.skipped_steps += 1
        return {"grad_norm": 0.0, "skipped_steps": self.skipped_steps, "tokens": 0, "sequences": 0}

    def close_step(self, stats: dict, tokens: int, sequences: int, divisor: float | None = None) -> dict:
        """The one optimizer update on the accumulated gradients (first divided by `divisor`, when given),
        and `train_step`'s metrics: `stats` plus this rank's `tokens` and `sequences`."""
        grad_norm, applied = self._optimizer_step() if divisor is None else self._rescaled_optimizer_step(divisor)
        self.skipped_steps += not applied
        self.updates += 1
        sync = self.cfg.kl.ref_sync_steps
        if sync is not None and self.updates % sync == 0:
            self._mix_into_reference(self.cfg.kl.ref_mixup_alpha)
        out = dict(stats, grad_norm=grad_norm, skipped_steps=self.skipped_steps, tokens=tokens, sequences=sequences)
        return out | self.pacer_counts()

    def pacer_counts(self) -> dict:
        """The pacer's cumulative counts, as train metrics (summed over ranks)."""
        return {f"emulate_{k}": v for k, v in self.pacer.counts().items()} if self.pacer else {}

    def train_mini_batches(self, parts: list[tuple[list[TrainSample], StepTotals]], fresh: bool,
                           proximal_micro_batches: int = 0, version: int | None = None) -> dict:
        """One optimizer step per part (veRL's PPO mini-batches) on a rollout batch. From the second part
        on the weights have moved, so every part is scored against the proximal policy (the weights at
        the start, of `version`), taken as `proximal_source` says: the behaviour log-probs when `fresh`
        (every token sampled by these very weights), else recomputed here, or interpolated from each part's
        own forward. Statistics are means over the parts that report them (mismatch_kl: the first alone);
        tokens and sequences are sums."""
        source = proximal_source(self.cfg, fresh, version)
        if len(parts) > 1:
            # The first part runs on the proximal weights themselves: its own forward is pi_prox, exactly, so
            # only the later parts need one recomputed (a quarter of that forward saved at 4 mini-batches),
            # or interpolated from their own forwards (accumulate_gradients). With trainer.ppo_epochs a sample
            # comes again in later passes: scored once, and the first part's keep their own forward.
            first = {id(s) for s in parts[0][0]}
            later = list({id(s): s for part, _ in parts[1:] for s in part if id(s) not in first}.values())
            if source != "loglinear":
                proximal = ([s.logprobs for s in later] if source == "behaviour" else
                            self.compute_logprobs(later, proximal_micro_batches))
            for i, sample in enumerate(later):
                sample.proximal_logprobs = None if source == "loglinear" else list(proximal[i])
            for sample in parts[0][0]:  # behaviour: pi_old is the engine's for every part alike (losses.py)
                sample.proximal_logprobs = list(sample.logprobs) if source == "behaviour" else None
        interpolate_at = version if source == "loglinear" else None
        per_part = [self.train_step(samples, totals, interpolate_at if i else None, at_start=i == 0)
                    for i, (samples, totals) in enumerate(parts)]
        return self.merge_mini_batches(per_part) | {"lr": self.end_step()}

    def end_step(self) -> float:
        """The rate this train step's updates took; the schedule moves on to the next step's (schedule.py)."""
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # a first step skipped (non-finite, no tokens) skips no rate: it counts steps
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return lr

    def merge_mini_batches(self, per_part: list[dict]) -> dict:
        """A step's metrics from its mini-batches' (`train_step`'s): means over the parts that report a
        statistic, sums of tokens and sequences, the last part's skip count, the pacer's counts now."""
        keys = set().union(*per_part)
        merged = {k: sum(m[k] for m in per_part if k in m) / sum(k in m for m in per_part) for k in keys}
        merged.update(tokens=sum(m["tokens"] for m in per_part), sequences=sum(m["sequences"] for m in per_part),
                      skipped_steps=per_part[-1]["skipped_steps"], **self.pacer_counts())
        return merged

    def accumulate_gradients(self, samples: list[TrainSample], totals: StepTotals, closes_step: bool = True,
                             interpolate_at: int | None = None, at_start: bool = True) -> dict:
        """`closes_step=False`: more parts follow (a streamed step, streamed.py), so no micro-batch is the last.
        `interpolate_at`: pi_prox is `loglinear_proximal` from this forward, for weights that started the
        step at that version; otherwise the samples' own proximal log-probs, or this forward where they have
        none (the weights have not moved). `at_start`: this forward runs on the weights that started the
        step, so it measures the rollout-trainer mismatch (mismatch_kl)."""
        if totals.micro_batches < 1:
            raise ValueError("a train step needs at least one sample with response tokens")
        stats: dict[str, float] = defaultdict(float)
        batches = self._micro_batches(samples, totals.micro_batches)
        for i, batch in enumerate(batches):
            started = time.perf_counter()
            self._start_micro_batch(last=closes_step and i == len(batches) - 1)
            mb = collate(batch).to(self.device)
            logprobs, entropy = self._score(self.model, mb)
            if mb.proximal_logprobs is not None:
                proximal = mb.proximal_logprobs
            elif interpolate_at is not None:
                proximal = loglinear_proximal(mb.behaviour_logprobs, logprobs.detach(), mb.versions, interpolate_at)
            else:
                proximal = logprobs.detach()
                if at_start and self.cfg.ppo_epochs > 1:  # the starting weights' own: pi_old of the later passes
                    for row, sample in enumerate(batch):
                        sample.proximal_logprobs = proximal[row, sample.prompt_len - 1:sample.num_tokens - 1].tolist()
            inp = LossInputs(logprobs, proximal, mb.behaviour_logprobs, mb.advantages, mb.response_mask,
                             float(totals.tokens), float(totals.sequences),
                             self._reference_logprobs(mb), mb.versions, entropy,
                             start_logprobs=logprobs.detach() if at_start else None)
            loss, mb_stats = compute_loss(inp, self.cfg)
            self._backward(loss)
            self._pace(started, batch, costs.TRAIN_FLOPS + (costs.FORWARD_FLOPS if self.reference else 0))
            for k, v in mb_stats.items():
                stats[k] += v
        return dict(stats)

    def _pace(self, started: float, batch: list[TrainSample], flops_per_param_token: float) -> None:
        # An empty micro-batch (a rank's padding, DeepSpeed's boundary before a streamed update) is modelled at
        # no time, so holding it would count its real compute as an overrun.
        if self.pacer and batch:
            self.pacer.micro_batch(started, sum(s.num_tokens for s in batch), flops_per_param_token,
                                   prompts=len(batch), prompt_tokens=sum(s.prompt_len for s in batch))

    def _micro_batches(self, samples: list[TrainSample], count: int) -> list[list[TrainSample]]:
        batches = pack_micro_batches(samples, self.cfg.micro_batch_tokens)
        return batches + [[] for _ in range(count - len(batches))]

    def _score(self, model: torch.nn.Module, mb: MicroBatch):
        return scored_forward(model, mb, self.scoring, self.cfg.logprob_chunk_tokens)

    def _reference_logprobs(self, mb: MicroBatch):
        if not self.cfg.kl.in_loss:
            return None
        with torch.no_grad():
            return self._score(self.reference, mb)[0]

    def _make_reference(self) -> torch.nn.Module | None:
        """The initial weights, frozen, in the training dtype, for the KL term (None without one); with
        trainer.lora the policy's own base weights, its adapters switched off for the reference's forward."""
        if not self.cfg.kl.enabled:
            return None
        if self.cfg.lora.enabled:
            return lora.AdaptersOff(self._hf_model())
        return self._frozen_initial_model()

    def _frozen_initial_model(self) -> torch.nn.Module:
        return load_model(self.model_dir, DTYPES[self.cfg.dtype]).requires_grad_(False).to(self.device)

    def _load_trained_model(self) -> torch.nn.Module:
        """The model this backend trains, in the training dtype: the policy (a critic: its value model)."""
        return load_model(self.model_dir, DTYPES[self.cfg.dtype])

    # --- the reference refreshed every trainer.kl.ref_sync_steps updates (TRL's sync_ref_model) ------------------
    def _reference_module(self) -> torch.nn.Module:
        return getattr(self.reference, "module", self.reference)  # the HF model inside a DeepSpeed engine

    @torch.no_grad()
    def _mix_into_reference(self, alpha: float) -> None:
        """ref <- alpha x policy + (1 - alpha) x ref, parameter by parameter (TRL's TR-DPO mixup)."""
        for ref, param in zip(self._reference_module().parameters(), self._hf_model().parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(param.detach().to(ref.dtype), alpha=alpha)

    def _load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        self._reference_module().load_state_dict(weights)

    # --- what a backend provides -----------------------------------------------------------------
    def _start_micro_batch(self, last: bool) -> None:
        """Called before each forward; DeepSpeed needs to know which one ends the step."""

    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip and step unless the gradients are not finite; return (grad norm before clipping, applied)."""

    def _rescaled_optimizer_step(self, divisor: float) -> tuple[float, bool]:
        """`_optimizer_step` on the accumulated gradients divided by `divisor` (a streamed step's normaliser)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        return self._optimizer_step()

    @abstractmethod
    def _hf_model(self) -> torch.nn.Module:
        """The Hugging Face model itself (inside any wrapper; with trainer.lora, the PeftModel around it)."""

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor where it lives), one at a time, in state_dict order: use each before asking for
        the next (under ZeRO-3 a parameter is gathered only meanwhile, a collective: every rank reads all).
        With trainer.lora, the merged weights under the base model's names (lora.py)."""
        if self.cfg.lora.enabled:
            return lora.merged_weights(self._hf_model(), self._weights_of)
        return self._weights_of(self._hf_model())

    def published_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What each new version sends the engines, as `rollout_weights`: all of them, or with trainer.lora
        the merged weights of the adapted layers alone (the engines loaded the rest, the frozen base, at start)."""
        if self.cfg.lora.enabled:
            return lora.merged_weights(self._hf_model(), self._weights_of, changed_only=True)
        return self.rollout_weights()

    def reference_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The reference's weights, as `rollout_weights`."""
        return self._weights_of(self._reference_module())

    def _weights_of(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors(model):
            yield name, t.detach()

    def published_shapes(self) -> dict[str, torch.Tensor]:
        """The published weights' names, shapes and dtypes as "meta" tensors (no memory, no collective)."""
        model = self._hf_model()
        tensors = (lora.merged_shapes(model, named_tensors, changed_only=True) if self.cfg.lora.enabled
                   else dict(named_tensors(model)))
        return {name: torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")
                for name, t in tensors.items()}

    def state_dict_for_rollout(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full weights, HF names, CPU float32, read one parameter at a time; only with `keep` does this rank
        hold the copy (checkpoints, exports: rank 0). Publishing streams instead (rlsys/weights/transfer.py)."""
        return cpu_copy(self.rollout_weights(), keep)

    @abstractmethod
    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (with trainer.lora: the adapters, by the PeftModel's names) into the model."""

    def _weights_file(self) -> str:
        return ADAPTER_FILE if self.cfg.lora.enabled else "model.safetensors"

    def _checkpoint_weights(self, keep: bool) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the weights: all, or with trainer.lora the adapters alone."""
        if self.cfg.lora.enabled:
            return cpu_copy(lora.adapter_weights(self._hf_model()).items(), keep)
        return self.state_dict_for_rollout(keep)

    def _layout(self) -> dict:
        return {"backend": self.name, "world_size": self.world_size}

    def _check_layout(self, layout: dict, folder: Path) -> None:
        if layout != self._layout():
            raise ValueError(f"{folder} was written by a trainer with {layout}; this one is {self._layout()}: "
                             "resume with the same trainer.backend, trainer.world_size and trainer.zero_stage")

    def _save_optimizer(self, folder: Path) -> None:
        if self.rank == 0:
            save_state(self.optimizer.state_dict(), folder, "optimizer_rank0")

    def _load_optimizer(self, folder: Path) -> None:
        self.optimizer.load_state_dict(load_state(folder, "optimizer_rank0"))

    # --- files ----------------------------------------------------------------------------------
    def save(self, folder: str) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = self._checkpoint_weights(keep=self.rank == 0)
        if self.rank == 0:
            save_tensors(weights, folder / self._weights_file())
            (folder / LAYOUT_FILE).write_text(json.dumps(self._layout()))
        self._save_optimizer(folder)
        if self.cfg.kl.ref_sync_steps is not None:  # the reference has moved from the initial weights
            reference = cpu_copy(self.reference_weights(), keep=self.rank == 0)
            if self.rank == 0:
                save_tensors(reference, folder / REFERENCE_FILE)
        save_state({"rng": rng_state(), "skipped_steps": self.skipped_steps, "updates": self.updates,
                    "lr_steps": self.scheduler.last_epoch}, folder, f"state_rank{self.rank}")

    def load(self, folder: str) -> None:
        folder = Path(folder)
        layout = json.loads((folder / LAYOUT_FILE).read_text())
        self._check_layout(layout, folder)
        self._load_weights(load_file(str(folder / self._weights_file())))
        self._load_optimizer(folder)
        # A rank the saving run did not have (a larger world) takes rank 0's RNG states and counters.
        own = folder / f"state_rank{self.rank}.json"
        state = load_state(folder, own.stem if own.exists() else "state_rank0")
        set_rng_state(state["rng"])
        self.skipped_steps = state["skipped_steps"]
        self.updates = state.get("updates", 0)
        self.scheduler = lr_scheduler(self.optimizer, self.cfg, state.get("lr_steps", 0))  # the rate it left off at
        if self.cfg.kl.ref_sync_steps is not None and (folder / REFERENCE_FILE).exists():
            self._load_reference(load_file(str(folder / REFERENCE_FILE)))

    def export_hf(self, folder: str) -> None:
        """A standard HF model folder with the current weights (no tokenizer: the caller adds it); with
        trainer.lora the merged weights, and the adapters in peft's format under ADAPTER_EXPORT."""
        weights = self.state_dict_for_rollout(keep=self.rank == 0)
        if self.rank == 0:
            write_hf_model(weights, self.model_dir, folder)
            if self.cfg.lora.enabled:
                self._hf_model().save_pretrained(str(Path(folder) / ADAPTER_EXPORT))


class TorchBackend(TrainerBackend):
    """Plain torch AdamW on the HF model, one process."""

    name = "torch"

    def __init__(self, cfg: TrainerConfig, model_dir: str, scoring: Scoring, rank: int = 0, world_size: int = 1):
        if world_size != 1:
            raise ValueError(f"TorchBackend runs on one rank, not {world_size}: use DeepSpeedBackend")
        super().__init__(cfg, model_dir, scoring, rank, world_size, local_device())
        self.model = self._load_trained_model()
        if cfg.lora.enabled:
            self.model = lora.add_adapters(self.model, cfg.lora)
        self.model = self.model.to(self.device)
        self.reference = self._make_reference()
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.optimizer = torch.optim.AdamW(trained_parameters(self.model), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, cfg)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> tuple[float, bool]:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        applied = bool(np.isfinite(norm))
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def _hf_model(self) -> torch.nn.Module:
        return self.model

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        load_weights(self.model, weights, self.cfg.lora.enabled)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], adapters_only: bool) -> None:
    """`weights` into `model`: all of its tensors, or (`adapters_only`) exactly its trained ones."""
    if not adapters_only:
        model.load_state_dict(weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    wanted = set(lora.adapter_weights(model))
    if unexpected or wanted & set(missing):
        raise ValueError(f"the checkpoint's adapters do not fit trainer.lora (missing {sorted(wanted & set(missing))[:3]}, "
                         f"unexpected {unexpected[:3]}): resume with the trainer.lora it was written with")

