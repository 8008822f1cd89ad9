"""Policy losses, one per-token function each, registered by name and selected by `trainer.loss`.

A loss sees one micro-batch as `LossInputs` ([B, T] tensors over predicted positions, with a mask
for response tokens) and returns a per-token loss plus per-token statistics. `compute_loss` weights
it by the rollout-trainer mismatch correction, adds the optional KL term and aggregates with
`trainer.loss_aggregation` (default: the loss's own mode). Aggregation divides by the token or
sequence count of the whole step (all micro-batches, all ranks), so summing the returned losses
over micro-batches and ranks gives exactly the loss of the step taken as one batch; every returned
statistic is a share of the step's value in the same way.

To add a loss: write `fn(inp, cfg) -> (per_token_loss, {stat_name: per_token_tensor})` and decorate
it with `@register_policy_loss(name, aggregation)`. Behaviour log-probs, proximal log-probs and
per-token versions are all in `inp`.

Conventions (where they differ from, or are not written down by, veRL):
- Log-ratios log(pi / pi_old) and the mismatch log-weight log(pi_old / pi_behav) are clamped to
  +-20 before exp, as veRL does: a token beyond that adds a bounded loss and no gradient, where an
  inf would have made the step's gradient non-finite and the whole step skipped.
- KL to the reference: k1 and k2 are not clamped (they are polynomials, finite, and keep their
  gradient); k3 clamps its log-ratio to +-20 and its value to [-10, 10], as veRL's low_var_kl.
- Mismatch correction: rho = pi_old / pi_behav, per token or (level=sequence) the product over
  the sequence. tis weights by min(rho, threshold); mis by rho, or 0 outside [threshold_low,
  threshold]. The weight is detached. A masked token keeps its place in the step's token and
  sequence counts (as AReaL's cap does), so masking never inflates the other tokens' weight and
  aggregation stays exact across micro-batches. A token that trainer.mismatch.reject rejects leaves them
  instead, as veRL's rejection does (`kept_share`). The behaviour log-probs hold both the engine's
  numerics and staleness (the version that sampled), so one weight corrects both: decoupled_ppo's
  staleness weight *is* this weight (bounded by its `is_cap` when trainer.mismatch.mode is none),
  never a second factor. ppo_naive compares to the behaviour policy itself, so it refuses a
  correction.
- pi_old of a stale sample in a later mini-batch (the weights have moved since the step began) is
  recomputed by default; `trainer.proximal=loglinear` takes AReaL's approximation instead
  (`loglinear_proximal`), which needs no extra forward.
- pi_old is always the trainer's own when a correction is on: with fresh samples and several
  mini-batches rlsys otherwise reuses the engine's log-probs as pi_old (no extra forward), and
  then rho = 1. `mismatch_kl` is measured against the trainer's own log-probs whatever the mode: those
  of the first mini-batch's forward, which runs on the weights that started the step.
- GSPO's sequence log-ratio (the mean of its token log-ratios, not clamped one by one) is clamped from
  above at 10 before exp, with no gradient beyond, as veRL's GSPO. With a token-level mismatch weight its
  gradient on each token carries the sequence's mean weight by default (`trainer.gspo_token_weights=mean`,
  TRL's); `own` gives each token its own weight (veRL's). The loss value is the same either way.
- trainer.eps_high unset means the loss's own upper clip: 0.28 (DAPO's clip-higher) for dapo, decoupled_ppo,
  ppo_naive and dg_clipped, eps_low (symmetric, veRL's 0.2 / 0.2) for the others; set, every clipped loss
  honours it (as veRL's vanilla loss and TRL's grpo do), and a loss with no ratio clip refuses it at load.
- Dual-clip (trainer.clip_ratio_c) bounds the loss of a token with A < 0 at -A * c, for every loss built on
  PPO's clipped surrogate (`clipped_objective`); off by default (veRL's default is on, c = 3). The others
  refuse it and trainer.delta at load.
- The round-two options (entropy bonus, cispo, gmpo, clip_cov, kl_cov, delta, bias-corrected and in-reward
  KL, mismatch rejection, off-policy masking, top-entropy share): docs/design.md "Loss options".
- seq_mean_token_sum_norm divides the step's token sum by (sequences x trainer.loss_scale_tokens),
  a constant (rollout.max_new_tokens unless set), as TRL's dr_grpo does (veRL's default dp_actor divides each
  micro-batch's token sum by L and the accumulation count: rlsys's loss times the per-GPU micro-batch size);
  token_sum_norm by the constant alone, as veRL's agg_loss under its global-batch engine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

from rlsys.config import MismatchConfig, TrainerConfig
from rlsys.registry import Registry

if TYPE_CHECKING:  # torch is imported where a loss is computed: `rlsys check` reads the registry without it
    from torch import Tensor

LOG_RATIO_BOUND = 20.0  # |log ratio| beyond this is clamped before exp (veRL's bound)
GSPO_LOG_RATIO_BOUND = 10.0  # GSPO's sequence log-ratio is clamped from above at this (veRL's GSPO)
DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher: the upper eps of its family of losses when trainer.eps_high is not set


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
    entropy: Optional[Tensor] = None  # the current policy's entropy at each position; carries a gradient
    # The trainer's own log-probs under the weights that started the step, where this forward knows them (the
    # first mini-batch's forward); `mismatch_kl` is measured against them, in every mode, and not without them.
    start_logprobs: Optional[Tensor] = None


def loglinear_proximal(behaviour: Tensor, current: Tensor, versions: Tensor, version: int) -> Tensor:
    """AReaL's log-linear pi_prox: the log-probs taken as linear in the policy version between the token's
    behaviour policy (version v) and the step's target (version + 1), read at the step's start (version):
    log pi_prox = log pi_behav + alpha (log pi - log pi_behav), alpha = (version - v) / (version + 1 - v).
    A token sampled by the starting weights keeps its behaviour log-prob (alpha 0), one a version older
    lies halfway. `current` is the mini-batch's own forward, detached."""
    import torch
    alpha = ((version - versions) / (version + 1 - versions).clamp(min=1)).clamp(0.0, 1.0)
    return torch.lerp(behaviour, current, alpha.to(current.dtype))


PerTokenLoss = Callable[[LossInputs, TrainerConfig], "tuple[Tensor, dict[str, Tensor]]"]


@dataclass(frozen=True)
class PolicyLoss:
    per_token: PerTokenLoss
    aggregation: str  # a key of AGGREGATIONS, used unless trainer.loss_aggregation names another
    # The correction it always takes when trainer.mismatch.mode is none (decoupled_ppo's capped weight).
    default_correction: Optional[Callable[[TrainerConfig], MismatchConfig]] = None
    ratio_to_behaviour: bool = False  # pi_old is the behaviour policy itself: nothing left to correct
    # Its upper clip when trainer.eps_high is not set: a number, or None for eps_low (a symmetric clip).
    eps_high: Optional[float] = DAPO_EPS_HIGH
    clipped: bool = True  # False: no ratio clip, so trainer.eps_high has no meaning and is refused
    # False: not PPO's clipped surrogate, so trainer.delta and trainer.clip_ratio_c have no meaning and are refused
    ppo_surrogate: bool = True
    # One loss per sequence: a token-level mismatch weight enters as the sequence's geometric mean (veRL's GMPO)
    geometric_weight: bool = False


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, aggregation: str, **options):
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}")

    def add(fn: PerTokenLoss) -> PerTokenLoss:
        POLICY_LOSSES.register(name)(PolicyLoss(fn, aggregation, **options))
        return fn
    return add


# --- aggregation: always over the whole step, never per micro-batch ---------------------------
def token_mean(x: Tensor, inp: LossInputs, cfg: TrainerConfig | None = None) -> Tensor:
    """Sum over every response token of the step / the step's token count (DAPO)."""
    return (x * inp.mask).sum() / max(inp.step_tokens, 1.0)


def seq_mean_token_mean(x: Tensor, inp: LossInputs, cfg: TrainerConfig | None = None) -> Tensor:
    """Mean over each sequence's tokens, then mean over the step's sequences (GRPO)."""
    per_sequence = (x * inp.mask).sum(-1) / inp.mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / max(inp.step_sequences, 1.0)


def seq_mean_token_sum(x: Tensor, inp: LossInputs, cfg: TrainerConfig | None = None) -> Tensor:
    """Sum over each sequence's tokens, then mean over the step's sequences: long sequences weigh more."""
    return (x * inp.mask).sum() / max(inp.step_sequences, 1.0)


def constant_length(cfg: TrainerConfig | None, aggregation: str) -> int:
    """Dr.GRPO's constant that each sequence's token sum is divided by (trainer.loss_scale_tokens)."""
    if cfg is None or cfg.loss_scale_tokens is None:
        raise ValueError(f"trainer.loss_aggregation={aggregation} needs trainer.loss_scale_tokens "
                         "(Dr.GRPO's constant, e.g. rollout.max_new_tokens)")
    return cfg.loss_scale_tokens


def seq_mean_token_sum_norm(x: Tensor, inp: LossInputs, cfg: TrainerConfig | None = None) -> Tensor:
    """Dr.GRPO as TRL's dr_grpo takes it: each sequence's token sum / a constant length, then mean over the step's
    sequences (veRL's default dp_actor's is this times its per-GPU micro-batch size: docs/design.md)."""
    return seq_mean_token_sum(x, inp) / constant_length(cfg, "seq_mean_token_sum_norm")


def token_sum_norm(x: Tensor, inp: LossInputs, cfg: TrainerConfig | None = None) -> Tensor:
    """Dr.GRPO as veRL's agg_loss takes it under its global-batch engine: the step's token sum / a constant length,
    not divided by the sequence count."""
    return (x * inp.mask).sum() / constant_length(cfg, "token_sum_norm")


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                "seq_mean_token_sum": seq_mean_token_sum, "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
                "token_sum_norm": token_sum_norm}
# What each divides by, of the step's totals (a streamed step divides by it once the round has ended).
STEP_NORMALISER = {"token_mean": "tokens", "seq_mean_token_mean": "sequences", "seq_mean_token_sum": "sequences",
                   "seq_mean_token_sum_norm": "sequences", "token_sum_norm": "constant"}


def aggregation_of(cfg: TrainerConfig) -> str:
    return cfg.loss_aggregation or POLICY_LOSSES.get(cfg.loss).aggregation


def clip_range(cfg: TrainerConfig) -> tuple[float, float]:
    """(eps_low, eps_high) of the loss: trainer.eps_high where set, else the loss's own upper eps."""
    if cfg.eps_high is not None:
        return cfg.eps_low, cfg.eps_high
    own = POLICY_LOSSES.get(cfg.loss).eps_high
    return cfg.eps_low, cfg.eps_low if own is None else own


def check_loss_options(cfg: TrainerConfig) -> None:
    """Refuse an option the chosen loss gives no meaning (a loss not registered yet is checked when it runs)."""
    if cfg.loss not in POLICY_LOSSES:
        return
    policy = POLICY_LOSSES.get(cfg.loss)
    if cfg.eps_high is not None and not policy.clipped:
        raise ValueError(f"trainer.eps_high={cfg.eps_high}: trainer.loss={cfg.loss} clips no ratio, so it has "
                         "no upper clip to set; leave trainer.eps_high out")
    caps = {name: value for name in ("delta", "clip_ratio_c") if (value := getattr(cfg, name)) is not None}
    if caps and not policy.ppo_surrogate:
        fields = ", ".join(f"trainer.{name}={value}" for name, value in caps.items())
        raise ValueError(f"{fields}: trainer.loss={cfg.loss} is not PPO's clipped surrogate, so it has no unclipped "
                         f"ratio to cap; leave {' and '.join(f'trainer.{name}' for name in caps)} out")


# --- losses -------------------------------------------------------------------------------------
def bounded_exp(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def clipped_objective(ratio: Tensor, adv: Tensor, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(rho' A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho' = min(rho, delta) with trainer.delta (TRL's
    two-sided cap: with A < 0 no token loses more than -A delta); with dual-clip, at most -A c when A < 0."""
    import torch
    eps_low, eps_high = clip_range(cfg)
    capped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    loss = -torch.minimum(capped * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    # Tokens whose gradient the clip removed, split by side (clip-higher only moves the upper one).
    clipped_low = (ratio < 1 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1 + eps_high) & (adv > 0)
    clipped_dual = torch.zeros_like(clipped_low)
    if cfg.clip_ratio_c is not None:
        clipped_dual = (ratio > cfg.clip_ratio_c) & (adv < 0)
        loss = torch.where(clipped_dual, -adv * cfg.clip_ratio_c, loss)
    stats = {"clip_fraction": (clipped_low | clipped_high | clipped_dual).float(),
             "clip_fraction_low": clipped_low.float(), "clip_fraction_high": clipped_high.float(),
             "clip_fraction_dual": clipped_dual.float()}
    if cfg.delta is not None:
        stats["clip_fraction_delta"] = ((ratio > cfg.delta) & (adv < 0)).float()
    return loss, stats


def clipped_ppo(inp: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO objective with rho = pi / pi_old per token, the loss's clip range, trainer.delta and clip_ratio_c."""
    return clipped_objective(bounded_exp(inp.logprobs - inp.old_logprobs), inp.advantages, cfg)


@register_policy_loss("grpo", aggregation="seq_mean_token_mean", eps_high=None)
def grpo_loss(inp: LossInputs, cfg: TrainerConfig):
    """GRPO's clipped surrogate: symmetric unless trainer.eps_high is set (as veRL's vanilla loss, TRL's grpo)."""
    return clipped_ppo(inp, cfg)


@register_policy_loss("dapo", aggregation="token_mean")
def dapo_loss(inp: LossInputs, cfg: TrainerConfig):
    return clipped_ppo(inp, cfg)


@register_policy_loss("drgrpo", aggregation="seq_mean_token_sum_norm", eps_high=None)
def drgrpo_loss(inp: LossInputs, cfg: TrainerConfig):
    """Dr.GRPO: GRPO's clip, aggregated without the 1 / |y| that favours long wrong answers
    (pair it with trainer.advantage=drgrpo, which drops the std division)."""
    return clipped_ppo(inp, cfg)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, 1]: the mean of x over each sequence's response tokens."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


@register_policy_loss("gspo", aggregation="seq_mean_token_mean", eps_high=None)
def gspo_loss(inp: LossInputs, cfg: TrainerConfig):
    """GSPO: one ratio per sequence, s = (prod_t pi / pi_old)^(1 / |y|), clipped as a whole.

    Every token of a sequence carries the sequence's loss, so d loss / d log pi_t = s A / |y| under
    seq_mean_token_mean (GSPO's gradient). log s is clamped from above at 10 before exp, with no
    gradient beyond (veRL's GSPO). Its clip range is far narrower than PPO's: the paper uses eps_low
    3e-4, eps_high 4e-4. With a token-level mismatch weight, trainer.gspo_token_weights decides whose
    weight a token's gradient carries: the sequence's mean (`mean`, TRL) or its own (`own`, veRL, which
    writes s_t = sg[s] pi_t / sg[pi_t]: the same value and, unweighted, the same gradient).
    """
    log_s = sequence_mean(inp.logprobs - inp.old_logprobs, inp.mask)
    if cfg.gspo_token_weights == "own":
        log_s = inp.logprobs - inp.logprobs.detach() + log_s.detach()
    ratio = log_s.clamp(max=GSPO_LOG_RATIO_BOUND).exp().expand_as(inp.logprobs)
    return clipped_objective(ratio, inp.advantages, cfg)


@register_policy_loss("gmpo", aggregation="seq_mean_token_mean", eps_high=None, ppo_surrogate=False,
                      geometric_weight=True)
def gmpo_loss(inp: LossInputs, cfg: TrainerConfig):
    """GMPO (Zhao et al., 2025): -A exp(mean_t clip'(log rho_t)) per sequence, the geometric mean of the token
    ratios, each log-ratio clipped to [-eps_low, eps_high] on the side its advantage pushes it (PPO's min, taken
    in log space). eps are log-space bounds: the paper's range (e^-0.4, e^0.4) is eps_low = eps_high = 0.4."""
    import torch
    eps_low, eps_high = clip_range(cfg)
    log_ratio = inp.logprobs - inp.old_logprobs
    sign = inp.advantages.sign()
    kept = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-eps_low, eps_high))
    clipped = (kept != log_ratio) & (sign != 0)
    return -inp.advantages * bounded_exp(sequence_mean(kept, inp.mask)), {
        "clip_fraction": clipped.float(), "clip_fraction_low": (clipped & (sign < 0)).float(),
        "clip_fraction_high": (clipped & (sign > 0)).float()}


@register_policy_loss("cispo", aggregation="token_mean", eps_high=None, ppo_surrogate=False)
def cispo_loss(inp: LossInputs, cfg: TrainerConfig):
    """CISPO (MiniMax-M1): -sg[clip(rho, 1 - eps_low, 1 + eps_high)] A log pi. The clip bounds a token's weight
    and never removes its gradient (the paper clips above only: eps_low 1 leaves the weight unbounded below)."""
    eps_low, eps_high = clip_range(cfg)
    ratio = bounded_exp(inp.logprobs - inp.old_logprobs).detach()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -weight * inp.advantages * inp.logprobs, {
        "clip_fraction": (weight != ratio).float(), "clip_fraction_high": (ratio > 1 + eps_high).float()}


@register_policy_loss("sapo", aggregation="seq_mean_token_mean", clipped=False, ppo_surrogate=False)
def sapo_loss(inp: LossInputs, cfg: TrainerConfig):
    """SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization"): -f(rho) A with a soft gate in place of the clip,
    f(rho) = sigmoid(tau (rho - 1)) 4 / tau, tau = trainer.sapo_tau_pos where A > 0 and sapo_tau_neg elsewhere (as
    veRL and TRL). At rho = 1 its gradient is PPO's; it fades smoothly as rho leaves 1, faster for a larger tau."""
    import torch
    ratio = bounded_exp(inp.logprobs - inp.old_logprobs)
    tau = torch.where(inp.advantages > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * inp.advantages, {"sapo_gate": gate.detach()}


# --- entropy-collapse control by covariance (Cui et al., 2025, "The Entropy Mechanism of RL for LLMs") ----
def covariance(inp: LossInputs) -> Tensor:
    """Per token (A - mean A)(log pi - mean log pi), detached; the means over the micro-batch's response tokens."""
    tokens = inp.mask.sum().clamp(min=1.0)
    logprobs = inp.logprobs.detach()
    mean_adv, mean_logprob = (inp.advantages * inp.mask).sum() / tokens, (logprobs * inp.mask).sum() / tokens
    return (inp.advantages - mean_adv) * (logprobs - mean_logprob)


def top_tokens(score: Tensor, eligible: Tensor, count: int) -> Tensor:
    """A mask of the `count` eligible tokens of highest score (fewer if fewer are eligible)."""
    import torch
    score = score.masked_fill(~eligible, float("-inf")).flatten()
    count = min(count, int(eligible.sum()))
    picked = torch.zeros_like(score, dtype=torch.bool)
    picked[score.topk(count).indices] = True
    return picked.view_as(eligible)


def picked_count(inp: LossInputs, cfg: TrainerConfig) -> int:
    return max(int(cfg.cov_ratio * inp.mask.sum().item()), 1)


@register_policy_loss("clip_cov", aggregation="token_mean", eps_high=None)
def clip_cov_loss(inp: LossInputs, cfg: TrainerConfig):
    """Clip-Cov: the clipped surrogate, with the gradient of a share `cov_ratio` of tokens removed, those of
    highest covariance among the unclipped ones with covariance inside `clip_cov_bounds` (veRL draws them at
    random among those; rlsys takes the highest, so a step is reproducible)."""
    import torch
    loss, stats = clipped_ppo(inp, cfg)
    cov, (low, high) = covariance(inp), cfg.clip_cov_bounds
    eligible = (inp.mask > 0) & (stats["clip_fraction"] == 0) & (cov > low) & (cov < high)
    picked = top_tokens(cov, eligible, picked_count(inp, cfg))
    stats["cov_picked_fraction"] = picked.float()
    return torch.where(picked, torch.zeros_like(loss), loss), stats


@register_policy_loss("kl_cov", aggregation="token_mean", clipped=False, ppo_surrogate=False)
def kl_cov_loss(inp: LossInputs, cfg: TrainerConfig):
    """KL-Cov: the unclipped surrogate -rho A, plus kl_cov_coef |log rho| on a share `cov_ratio` of tokens, those
    of highest covariance."""
    import torch
    log_ratio = inp.logprobs - inp.old_logprobs
    loss = -bounded_exp(log_ratio) * inp.advantages
    picked = top_tokens(covariance(inp), inp.mask > 0, picked_count(inp, cfg))
    loss = torch.where(picked, loss + cfg.kl_cov_coef * log_ratio.abs(), loss)
    return loss, {"cov_picked_fraction": picked.float()}


# --- staleness-robust losses (docs/design.md "Decoupled PPO", "Delightful Policy Gradient") -------------
def areal_cap(cfg: TrainerConfig) -> MismatchConfig:
    """AReaL's weight: rho per token, tokens with rho > `is_cap` dropped (token-level mis); trainer.mismatch's
    rejection on top, if set."""
    m = cfg.mismatch
    return MismatchConfig(mode="mis", level="token", threshold=cfg.is_cap, warn_kl=None, reject=m.reject,
                          reject_threshold=m.reject_threshold, reject_threshold_low=m.reject_threshold_low,
                          reject_level=m.rejection_level if m.reject else None)


@register_policy_loss("decoupled_ppo", aggregation="token_mean", default_correction=areal_cap)
def decoupled_ppo_loss(inp: LossInputs, cfg: TrainerConfig):
    """w * clipped_surrogate(pi / pi_prox, A), w = pi_prox / pi_behav: DAPO's surrogate that always takes
    the mismatch weight, capped at `is_cap` unless trainer.mismatch bounds it otherwise.

    A dropped token adds zero but stays in the step's token count (as AReaL does), so dropping does
    not inflate the weight of the others. With behaviour == proximal, w = 1 and this is `dapo`.
    """
    return clipped_ppo(inp, cfg)


@register_policy_loss("ppo_naive", aggregation="token_mean", ratio_to_behaviour=True)
def ppo_naive_loss(inp: LossInputs, cfg: TrainerConfig):
    """Standard PPO that ignores staleness: the behaviour policy plays pi_old, there is no proximal
    policy and no importance weight (the "naive PPO" of AReaL's ablation). DAPO's clip-higher eps."""
    return clipped_ppo(replace(inp, old_logprobs=inp.behaviour_logprobs), cfg)


def delight_gate(advantages: Tensor, logprobs: Tensor, eta: float) -> Tensor:
    """sigmoid(A * l / eta), l = -log pi (detached): rare successes pass, rare failures are damped."""
    import torch
    return torch.sigmoid(advantages * -logprobs.detach() / eta)


def gate_stats(gate: Tensor) -> dict[str, Tensor]:
    """Mean gate, and the shares of tokens it nearly shuts (< 0.1) and nearly fully opens (> 0.9)."""
    return {"dg_gate": gate, "dg_gate_low": (gate < 0.1).float(), "dg_gate_high": (gate > 0.9).float()}


@register_policy_loss("dg", aggregation="token_mean", clipped=False, ppo_surrogate=False)
def dg_loss(inp: LossInputs, cfg: TrainerConfig):
    """Delightful Policy Gradient: -gate * A * log pi per token; needs no behaviour log-probs."""
    gate = delight_gate(inp.advantages, inp.logprobs, cfg.dg_eta)
    return -gate * inp.advantages * inp.logprobs, gate_stats(gate)


@register_policy_loss("dg_clipped", aggregation="token_mean")
def dg_clipped_loss(inp: LossInputs, cfg: TrainerConfig):
    """The gate times DAPO's clipped surrogate against the proximal policy.

    The gate decides how much a token counts, the clip how far one batch may move the policy: the two
    act on different things, so they multiply. At ratio 1 (one optimizer step per train step) the
    gradient is exactly `dg`'s; the clip only bites when a batch takes several steps.
    """
    gate = delight_gate(inp.advantages, inp.logprobs, cfg.dg_eta)
    loss, stats = clipped_ppo(inp, cfg)
    stats.update(gate_stats(gate))
    return gate * loss, stats


# --- rollout-trainer mismatch ---------------------------------------------------------------------
def rejection_statistic(log_rho: Tensor, estimator: str) -> Tensor:
    """veRL's rollout rejection statistic per token from log rho = log(pi_old / pi_behav), clamped to +-20 and the
    value left unbounded: k1 = log(pi_behav / pi_old) (signed), k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho."""
    log_rho = log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho ** 2
    return log_rho.exp() - 1.0 - log_rho


def mismatch_rejected(inp: LossInputs, m: MismatchConfig) -> Tensor:
    """Response tokens rejected (veRL's rollout_rs): by their own statistic, or every token of a sequence by the
    mean, sum or max of its tokens' (trainer.mismatch.reject_level). k1 must lie within the logs of the ratio bounds
    [reject_threshold_low, reject_threshold]; k2 and k3 at most reject_threshold."""
    import math
    stat = rejection_statistic((inp.old_logprobs - inp.behaviour_logprobs).detach(), m.reject)
    level = m.rejection_level
    if level == "seq_mean":
        stat = sequence_mean(stat, inp.mask)
    elif level == "seq_sum":
        stat = (stat * inp.mask).sum(-1, keepdim=True)
    elif level == "seq_max":
        stat = stat.masked_fill(inp.mask <= 0, float("-inf")).amax(-1, keepdim=True)
    if m.reject == "k1":
        low, high = m.reject_bounds
        rejected = (stat < math.log(low)) | (stat > math.log(high))
    else:
        rejected = stat > m.reject_threshold
    return rejected.expand_as(inp.mask) & (inp.mask > 0)


def mismatch_weight(inp: LossInputs, m: MismatchConfig) -> tuple[Tensor, Tensor]:
    """The detached weight per token from rho = pi_old / pi_behav, and which tokens it truncated or masked."""
    import torch
    log_rho = (inp.old_logprobs - inp.behaviour_logprobs).detach() * inp.mask
    if m.level == "sequence":  # the product of the sequence's token ratios, on each of its tokens
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = bounded_exp(log_rho)
    if m.mode == "tis":
        return rho.clamp(max=m.threshold), rho > m.threshold
    if m.mode == "mis":
        bounded = (rho > m.threshold) | (rho < m.threshold_low)
        return torch.where(bounded, torch.zeros_like(rho), rho), bounded  # also zeroes an overflowed weight
    return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)  # rejection alone


def geometric_sequence_mean(weight: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's geometric mean of its tokens' weights, on each of its tokens, as veRL's GMPO takes a token
    weight (its 1e-10 and 1e-8 included: a zero weight makes the sequence's nearly zero)."""
    import torch
    log_mean = (torch.log(weight + 1e-10) * mask).sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + 1e-8)
    return log_mean.exp().expand_as(weight)


def correction_for(policy: PolicyLoss, cfg: TrainerConfig) -> MismatchConfig | None:
    """The mismatch correction this loss takes under `cfg`, or None."""
    if cfg.mismatch.mode == "none" and policy.default_correction:
        return policy.default_correction(cfg)
    if not cfg.mismatch.active:
        return None
    if policy.ratio_to_behaviour:
        raise ValueError(f"{cfg.mismatch.describe()}: trainer.loss={cfg.loss} already takes the "
                         "behaviour policy as pi_old, so a mismatch weight would count the mismatch twice; "
                         "use trainer.loss=decoupled_ppo or dapo")
    return cfg.mismatch


def mismatch_warning(metrics: dict, cfg: TrainerConfig) -> str | None:
    """A line to log when a step's (merged) mismatch KL is above trainer.mismatch.warn_kl."""
    kl, limit = metrics.get("mismatch_kl"), cfg.mismatch.warn_kl
    if kl is None or limit is None or kl <= limit:
        return None
    return (f"rollout-trainer mismatch: k3 KL(pi_behav || pi_old) = {kl:.3g} per token is above "
            f"trainer.mismatch.warn_kl={limit:g} (stale samples or engine numerics: bf16, kernels); "
            f"trainer.mismatch.mode={cfg.mismatch.mode}")


# --- KL to the reference policy -------------------------------------------------------------------
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimates of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3; veRL's abs, and k1+, k3+:
    the value of k1 or k3 with the gradient of k2, a straight-through estimator of the KL's gradient)."""
    log_ratio = ref_logprobs - logprobs  # log(pi_ref / pi)
    if estimator.endswith("+"):
        k2 = 0.5 * log_ratio ** 2
        return k2 - k2.detach() + kl_penalty(logprobs, ref_logprobs, estimator[:-1]).detach()
    if estimator == "k1":
        return -log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":  # exp needs the clamp; the value bound keeps one far token from dominating (veRL)
        log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return (log_ratio.exp() - 1.0 - log_ratio).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2, k3, abs, k1+ or k3+")


def dropped_tokens(inp: LossInputs, cfg: TrainerConfig) -> dict[str, Tensor]:
    """Tokens whose policy loss the options drop, by the statistic that counts them. A dropped token keeps its
    place in the step's counts, as a mismatch mask does.
    - off_policy_masked: every token of a sequence with A < 0 and mean log(pi_behav / pi) above
      trainer.off_policy_mask (DeepSeek-V3.2's sequence mask; pi detached, as TRL's).
    - low_entropy_dropped: tokens below the (1 - trainer.top_entropy_share) quantile of the micro-batch's
      response-token entropies (TRL takes the quantile over its whole batch)."""
    import torch
    dropped = {}
    if cfg.off_policy_mask is not None:
        drift = sequence_mean(inp.behaviour_logprobs - inp.logprobs.detach(), inp.mask)
        dropped["off_policy_masked"] = ((inp.advantages < 0) & (drift > cfg.off_policy_mask)).expand_as(inp.mask)
    if cfg.top_entropy_share is not None and inp.entropy is not None:
        entropy = inp.entropy.detach()
        response = entropy[inp.mask > 0]
        floor = torch.quantile(response.float(), 1 - cfg.top_entropy_share) if response.numel() else 0.0
        dropped["low_entropy_dropped"] = entropy < floor
    return dropped


def compute_loss(inp: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss, and its share of each statistic (of every response token).

    A token that mismatch rejection rejects leaves the loss and its aggregation, as veRL's rejection leaves its
    response mask; the loss is still divided by the step's planned counts, so the backend divides the step's
    gradient by the share kept (`kept_share`) once every rank has seen its rejections."""
    import torch
    policy = POLICY_LOSSES.get(cfg.loss)
    correction = correction_for(policy, cfg)
    counted, token_stats, rejected = inp, {}, None
    sequence_stats: dict[str, Tensor] = {}
    if correction is not None and correction.reject is not None:
        rejected = mismatch_rejected(inp, correction)
        inp = replace(inp, mask=inp.mask * ~rejected)
        token_stats["mismatch_rejected_fraction"] = rejected.float()
        sequence_stats["mismatch_rejected_sequence_fraction"] = (inp.mask.sum(-1) == 0) & (counted.mask.sum(-1) > 0)
    per_token, loss_stats = policy.per_token(inp, cfg)
    token_stats.update(loss_stats)
    if correction is not None:
        weight, bounded = mismatch_weight(counted, correction)
        if policy.geometric_weight:
            weight = geometric_sequence_mean(weight, inp.mask)
        per_token = weight * per_token
        corrected = bounded if rejected is None else bounded | rejected
        token_stats.update(mismatch_weight=weight, mismatch_corrected_fraction=corrected.float())
    for name, dropped in dropped_tokens(inp, cfg).items():
        per_token = torch.where(dropped, torch.zeros_like(per_token), per_token)
        token_stats[name] = dropped.float()
    aggregation = AGGREGATIONS[aggregation_of(cfg)]
    stats = {"pg_loss": aggregation(per_token.detach(), inp, cfg).item()}
    if cfg.kl.in_loss:
        if inp.ref_logprobs is None:
            raise ValueError("trainer.kl is on but the backend gave no reference log-probs")
        kl = kl_penalty(inp.logprobs, inp.ref_logprobs, cfg.kl.estimator)
        if cfg.kl.bias_correction:  # TRL's: samples of pi_old reweighted to pi (the ratio keeps its gradient)
            kl = kl * bounded_exp(inp.logprobs - inp.old_logprobs)
        per_token = per_token + cfg.kl.coef * kl
        token_stats["kl"] = kl
    if inp.entropy is not None:
        token_stats["entropy"] = inp.entropy
        if cfg.entropy_coeff > 0:
            per_token = per_token - cfg.entropy_coeff * inp.entropy
    elif cfg.entropy_coeff > 0 or cfg.top_entropy_share is not None:
        raise ValueError("trainer.entropy_coeff and trainer.top_entropy_share need the entropy, and the backend "
                         "gave none")
    token_stats["behaviour_logprob_diff"] = (inp.logprobs - inp.behaviour_logprobs).abs()
    if inp.start_logprobs is not None:  # not old_logprobs: those are the engine's own when samples are fresh
        token_stats["mismatch_kl"] = kl_penalty(inp.behaviour_logprobs, inp.start_logprobs.detach(), "k3")
    loss = aggregation(per_token, inp, cfg)
    stats["loss"] = loss.item()
    stats.update({k: token_mean(v.detach(), counted).item() for k, v in token_stats.items()})
    stats.update({k: v.sum().item() / max(inp.step_sequences, 1.0) for k, v in sequence_stats.items()})
    return loss, stats


LOSS_STATS = ("loss", "pg_loss")  # aggregated by the loss's own mode; every other statistic is a token mean
# The statistics that hold the shares of the step's tokens and sequences that mismatch rejection removed.
REJECTED_SHARE = {"tokens": "mismatch_rejected_fraction", "sequences": "mismatch_rejected_sequence_fraction"}


def kept_share(stats: dict[str, float], cfg: TrainerConfig) -> float:
    """The share of the step's normaliser (its tokens, or sequences) that mismatch rejection kept, from the step's
    summed statistics: what the step's gradient, taken over the planned counts, is divided by. 1 where nothing
    is kept at all (the gradient is zero then) or the normaliser is a constant (token_sum_norm)."""
    name = REJECTED_SHARE.get(STEP_NORMALISER[aggregation_of(cfg)])
    kept = 1.0 - (stats.get(name, 0.0) if name else 0.0)
    return kept if kept > 1e-9 else 1.0
