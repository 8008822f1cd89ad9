"""LoRA on the policy through peft (trainer.lora), as veRL's LoRA recipes and TRL's PEFT integration do it.

Only the adapters train; the base weights stay frozen, so the optimizer (and ZeRO's partitions of it) holds
the adapters alone. The KL reference is the same model with its adapters switched off (`AdaptersOff`): no
second copy of the weights. Engines get merged weights, base + alpha / rank x B @ A, under the base model's
Hugging Face names (`merged_weights`), so they load them as any full update.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from peft import LoraConfig as PeftLoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from rlsys.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> PeftModel:
    """`model` with fresh LoRA adapters on `cfg.target_modules` (B = 0: the policy starts as the base)."""
    found = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [] if cfg.target_modules == "all-linear" else sorted(set(cfg.target_modules) - found)
    if missing:
        raise ValueError(f"trainer.lora.target_modules: the model has no module named {', '.join(missing)} "
                         f"(its linear layers: {', '.join(sorted(linear_names(model)))})")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=cfg.target_modules, bias="none", task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, peft_cfg)
    wrapped.eval()  # as load_model: no dropout, ever
    return wrapped


def linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


class AdaptersOff(torch.nn.Module):
    """The base model inside a PeftModel, as a module: its forward runs with the adapters disabled."""

    def __init__(self, peft_model: PeftModel):
        super().__init__()
        self.peft_model = [peft_model]  # in a list: not registered as a submodule, its parameters not ours

    def get_output_embeddings(self):
        return self.peft_model[0].get_output_embeddings()

    def forward(self, **kwargs):
        with self.peft_model[0].disable_adapter():
            return self.peft_model[0](**kwargs)


def merged_weights(peft_model: PeftModel, named: Callable[[torch.nn.Module], Iterator[tuple[str, torch.Tensor]]],
                   changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model's HF name, merged tensor), in its state_dict order: an adapted layer's weight is
    base + its delta (peft's get_delta_weight: alpha / rank x B @ A), computed in the weight's dtype; the
    adapters' own tensors are left out. `changed_only`: the adapted layers' weights alone, all that differs
    from the base. `named(module)` reads a module's tensors (the backend's `_weights_of`)."""
    for hf_name, tensor, layer in _base_tensors(peft_model, named, changed_only):
        yield hf_name, tensor if layer is None else tensor + layer.get_delta_weight(ADAPTER).to(tensor.dtype)


def merged_shapes(peft_model: PeftModel, named, changed_only: bool = False) -> dict[str, torch.Tensor]:
    """`merged_weights`' names with the base tensors (their shapes and dtypes), without merging."""
    return {hf_name: tensor for hf_name, tensor, _ in _base_tensors(peft_model, named, changed_only)}


def _base_tensors(peft_model: PeftModel, named, changed_only: bool):
    """(HF name, base tensor, the adapted layer whose delta it takes or None) of `merged_weights`."""
    hf = peft_model.get_base_model()
    adapted = {name: m for name, m in hf.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in named(hf):
        hf_name, layer = base_name(name, adapted)
        if hf_name is None:
            continue
        merged = layer if layer is not None and hf_name.endswith(".weight") else None  # a bias is not adapted
        if merged is not None or not changed_only:
            yield hf_name, tensor, merged


def base_name(name: str, adapted: dict[str, LoraLayer]) -> tuple[str | None, LoraLayer | None]:
    """A tensor's name in the base model and the adapted layer that owns it (None: a plain layer's);
    (None, None) for an adapter's own tensor."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        layer = adapted.get(".".join(parts[:i]))
        if layer is not None:
            if parts[i] != "base_layer":
                return None, None
            return ".".join(parts[:i] + parts[i + 1:]), layer
    return name, None


def adapter_weights(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The trained tensors (the adapters), under the PeftModel's own names: what a checkpoint keeps."""
    return {name: p.detach() for name, p in peft_model.named_parameters() if p.requires_grad}
