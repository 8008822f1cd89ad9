"""Policy losses, one per-token function each, registered by name and selected by `trainer.loss`.

A loss sees one micro-batch as `LossInputs` ([B, T] tensors over predicted positions, with a mask
for response tokens) and returns a per-token loss plus per-token statistics. `compute_loss` adds the
optional KL term and aggregates with the loss's own mode. Aggregation divides by the token or
sequence count of the whole step (all micro-batches, all ranks), so summing the returned losses
over micro-batches and ranks gives exactly the loss of the step taken as one batch; every returned
statistic is a share of the step's value in the same way.

To add a loss: write `fn(inp, cfg) -> (per_token_loss, {stat_name: per_token_tensor})` and decorate
it with `@register_policy_loss(name, aggregation)`. Behaviour log-probs, proximal log-probs and
per-token versions are all in `inp`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from rlsys.config import TrainerConfig
from rlsys.control.registry import Registry


@dataclass
class LossInputs:
    logprobs: Tensor  # current policy; the only input that carries a gradient
    old_logprobs: Tensor  # proximal policy: the weights at the start of the step
    behaviour_logprobs: Tensor  # recorded by the rollout engine when the token was sampled
    advantages: Tensor  # each sequence's advantage, repeated over its tokens
    mask: Tensor  # 1.0 on response tokens, 0.0 on prompt and padding
    step_tokens: float  # response tokens in the whole step
    step_sequences: float  # sequences in the whole step
    ref_logprobs: Optional[Tensor] = None  # frozen initial policy, when a KL term is on
    versions: Optional[Tensor] = None  # policy version that sampled each token


PerTokenLoss = Callable[[LossInputs, TrainerConfig], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    per_token: PerTokenLoss
    aggregation: str  # a key of AGGREGATIONS


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, aggregation: str):
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}")

    def add(fn: PerTokenLoss) -> PerTokenLoss:
        POLICY_LOSSES.register(name)(PolicyLoss(fn, aggregation))
        return fn
    return add


# --- aggregation: always over the whole step, never per micro-batch ---------------------------
def token_mean(x: Tensor, inp: LossInputs) -> Tensor:
    """Sum over every response token of the step / the step's token count (DAPO)."""
    return (x * inp.mask).sum() / max(inp.step_tokens, 1.0)


def seq_mean_token_mean(x: Tensor, inp: LossInputs) -> Tensor:
    """Mean over each sequence's tokens, then mean over the step's sequences (GRPO)."""
    per_sequence = (x * inp.mask).sum(-1) / inp.mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / max(inp.step_sequences, 1.0)


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean}


# --- losses -------------------------------------------------------------------------------------
def clipped_surrogate(inp: LossInputs, eps_low: float, eps_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), rho = pi / pi_old per token."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    adv = inp.advantages
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    # Tokens whose gradient the clip removed, split by side (clip-higher only moves the upper one).
    clipped_low = (ratio < 1 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, {"clip_fraction": (clipped_low | clipped_high).float(), "clip_fraction_low": clipped_low.float(),
                  "clip_fraction_high": clipped_high.float()}


@register_policy_loss("grpo", aggregation="seq_mean_token_mean")
def grpo_loss(inp: LossInputs, cfg: TrainerConfig):
    return clipped_surrogate(inp, cfg.eps_low, cfg.eps_low)


@register_policy_loss("dapo", aggregation="token_mean")
def dapo_loss(inp: LossInputs, cfg: TrainerConfig):
    return clipped_surrogate(inp, cfg.eps_low, cfg.eps_high)


# --- staleness-robust losses (DESIGN.md "Decoupled PPO", "Delightful Policy Gradient") -------------
@register_policy_loss("decoupled_ppo", aggregation="token_mean")
def decoupled_ppo_loss(inp: LossInputs, cfg: TrainerConfig):
    """w * clipped_surrogate(pi / pi_prox, A), w = pi_prox / pi_behav; tokens with w > `is_cap` dropped.

    A dropped token adds zero but stays in the step's token count (as AReaL does), so dropping does
    not inflate the weight of the others. With behaviour == proximal, w = 1 and this is `dapo`.
    """
    weight = torch.exp(inp.old_logprobs - inp.behaviour_logprobs).detach()
    capped = weight > cfg.is_cap
    weight = torch.where(capped, torch.zeros_like(weight), weight)  # also zeroes an overflowed inf
    loss, stats = clipped_surrogate(inp, cfg.eps_low, cfg.eps_high)
    stats.update(is_capped_fraction=capped.float(), is_weight=weight)  # is_weight: as used, 0 if dropped
    return weight * loss, stats


@register_policy_loss("ppo_naive", aggregation="token_mean")
def ppo_naive_loss(inp: LossInputs, cfg: TrainerConfig):
    """Standard PPO that ignores staleness: the behaviour policy plays pi_old, there is no proximal
    policy and no importance weight (the "naive PPO" of AReaL's ablation). DAPO's clip-higher eps."""
    return clipped_surrogate(replace(inp, old_logprobs=inp.behaviour_logprobs), cfg.eps_low, cfg.eps_high)


def delight_gate(inp: LossInputs, eta: float) -> Tensor:
    """sigmoid(A * l / eta), l = -log pi (detached): rare successes pass, rare failures are damped."""
    surprisal = -inp.logprobs.detach()
    return torch.sigmoid(inp.advantages * surprisal / eta)


def gate_stats(gate: Tensor) -> dict[str, Tensor]:
    """Mean gate, and the shares of tokens it nearly shuts (< 0.1) and nearly fully opens (> 0.9)."""
    return {"dg_gate": gate, "dg_gate_low": (gate < 0.1).float(), "dg_gate_high": (gate > 0.9).float()}


@register_policy_loss("dg", aggregation="token_mean")
def dg_loss(inp: LossInputs, cfg: TrainerConfig):
    """Delightful Policy Gradient: -gate * A * log pi per token; needs no behaviour log-probs."""
    gate = delight_gate(inp, cfg.dg_eta)
    return -gate * inp.advantages * inp.logprobs, gate_stats(gate)


@register_policy_loss("dg_clipped", aggregation="token_mean")
def dg_clipped_loss(inp: LossInputs, cfg: TrainerConfig):
    """The gate times DAPO's clipped surrogate against the proximal policy.

    The gate decides how much a token counts, the clip how far one batch may move the policy: the two
    act on different things, so they multiply. At ratio 1 (one optimizer step per train step) the
    gradient is exactly `dg`'s; the clip only bites when a batch takes several steps.
    """
    gate = delight_gate(inp, cfg.dg_eta)
    loss, stats = clipped_surrogate(inp, cfg.eps_low, cfg.eps_high)
    stats.update(gate_stats(gate))
    return gate * loss, stats


# --- KL to the reference policy -------------------------------------------------------------------
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimates of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # log(pi_ref / pi); clamped so exp stays finite
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return log_ratio.exp() - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def compute_loss(inp: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss, and its share of each statistic."""
    policy = POLICY_LOSSES.get(cfg.loss)
    per_token, token_stats = policy.per_token(inp, cfg)
    aggregate = AGGREGATIONS[policy.aggregation]
    stats = {"pg_loss": aggregate(per_token.detach(), inp).item()}
    if cfg.kl.estimator and cfg.kl.coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("trainer.kl is on but the backend gave no reference log-probs")
        kl = kl_penalty(inp.logprobs, inp.ref_logprobs, cfg.kl.estimator)
        per_token = per_token + cfg.kl.coef * kl
        token_stats["kl"] = kl
    token_stats["behaviour_logprob_diff"] = (inp.logprobs - inp.behaviour_logprobs).abs()
    loss = aggregate(per_token, inp)
    stats["loss"] = loss.item()
    stats.update({k: token_mean(v.detach(), inp).item() for k, v in token_stats.items()})
    return loss, stats
