"""Issue 51 against transcriptions of veRL's and TRL's functions on the same inputs (values and gradients, unequal
lengths, micro-batches summing to the step): rejection that leaves the step's counts, k1 as ratio bounds, seq_sum
and seq_max criteria, GMPO's geometric weight, Dr.GRPO's two normalisations, SAPO, the k1+ / k3+ / abs KL
estimators, REINFORCE++ and its baseline, TRL's batch-std scaling, truncated-completion masking, the options a
loss refuses, and the reference refreshed every N steps.

The reference functions below are transcribed from veRL (verl/trainer/ppo/core_algos.py, rollout_corr_helper.py,
verl/utils/torch_functional.py) and TRL (trl/trainer/grpo_trainer.py, callbacks.py), in float64."""
import math

import pytest
import torch

from rlsys.config import ConfigError, TrainerConfig
from rlsys.startup import load_config
from rlsys.trainer.advantages import group_advantages, step_advantages
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.losses import LossInputs, compute_loss, kept_share, kl_penalty
from rlsys.types import Completion, Group, Prompt, ScoredSample

from test_trainer import SCORING, make_groups, model_dir, trainer_config  # noqa: F401

LN = math.log


# --- reference functions, transcribed -----------------------------------------------------------------------------
def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def masked_whiten(values, mask):
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_agg_loss(loss_mat, mask, mode, loss_scale_factor=None):
    """veRL's agg_loss over one batch (dp 1, its global batch info that of this batch)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        seq_tokens = mask.sum(-1)
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
        seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum(-1).sum() / loss_scale_factor
    raise ValueError(mode)


def verl_vanilla(old, logp, adv, mask, mode, low=0.2, high=0.2, c=None, weights=None):
    """veRL's compute_policy_loss_vanilla (dual-clip off when c is None: rlsys's default)."""
    ratio = torch.exp((logp - old).clamp(-20, 20))
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    if c is not None:
        clipped = torch.where(adv < 0, torch.minimum(-adv * c, clipped), clipped)
    if weights is not None:
        clipped = clipped * weights
    return verl_agg_loss(clipped, mask, mode)


def verl_rejection_keep(log_ratio, mask, option, threshold):
    """veRL's compute_rollout_rejection_mask, one option; `threshold` as its string ("low_high" for k1)."""
    log_ratio = log_ratio.clamp(-20, 20)
    k1, k2, k3 = -log_ratio, 0.5 * log_ratio ** 2, torch.exp(log_ratio) - 1.0 - log_ratio
    stat = {"k1": k1, "k2": k2, "k3": k3}[option[-2:]]
    if option.startswith("seq_sum"):
        stat = (stat * mask).sum(-1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = masked_mean(stat, mask, -1).unsqueeze(-1)
    elif option.startswith("seq_max"):
        stat = stat.masked_fill(~mask.bool(), float("-inf")).max(-1, keepdim=True).values
    if option.endswith("k1"):
        low, high = (float(x) for x in threshold.split("_")) if "_" in threshold else (1 / float(threshold),
                                                                                       float(threshold))
        keep = (stat >= math.log(low)) & (stat <= math.log(high))
    else:
        keep = stat <= float(threshold)
    return mask * keep.expand_as(mask).to(mask.dtype)


def verl_geo_mean(old, logp, adv, mask, low, high, weights=None):
    """veRL's compute_policy_loss_geo_mean (GMPO)."""
    neg_kl = logp - old
    sgn = torch.sign(adv)
    kept = sgn * torch.min(sgn * neg_kl, sgn * neg_kl.clamp(-low, high))
    tokens = mask.sum(-1)
    ratio = torch.exp((kept * mask).sum(-1) / (tokens + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (tokens + 1e-8)
    losses = -seq_adv * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * mask).sum(-1) / (tokens + 1e-8))
    return losses.mean()


def verl_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """veRL's compute_policy_loss_sapo (TRL's loss_type="sapo" is the same per-token loss and aggregation)."""
    ratio = torch.exp((logp - old).clamp(-20, 20))
    taus = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return verl_agg_loss(-gates * adv, mask, "seq-mean-token-mean")


def trl_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL's _compute_loss for loss_type="sapo" (importance_sampling_level token, beta 0)."""
    coef_1 = torch.exp(logp - old)
    temperatures = torch.where(adv > 0, tau_pos, tau_neg)
    per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * adv
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def verl_kl_penalty(logp, ref, kind):
    """veRL's kl_penalty with its straight-through '+' (value of kind, gradient of k2)."""
    def forward(kind):
        if kind == "k1":
            return logp - ref
        if kind == "abs":
            return (logp - ref).abs()
        if kind == "k2":
            return 0.5 * (logp - ref).square()
        kl = (ref - logp).clamp(-20, 20)
        return (torch.exp(kl) - kl - 1).clamp(-10, 10)
    if not kind.endswith("+"):
        return forward(kind)
    backward = 0.5 * (logp - ref).square()
    return backward - backward.detach() + forward(kind[:-1]).detach()


def verl_reinforce_pp(scores, mask):
    """veRL's compute_reinforce_plus_plus_outcome_advantage, gamma 1, the score on each response's last token."""
    rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(scores)), last] = scores
    returns = torch.zeros_like(rewards)
    running = torch.zeros(len(scores), dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + 1.0 * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(scores, mask, index):
    """veRL's compute_reinforce_plus_plus_baseline_outcome_advantage."""
    scores = scores.clone()
    by_id = {}
    for i, idx in enumerate(index):
        by_id.setdefault(idx, []).append(scores[i])
    mean = {idx: torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=scores.dtype)
            for idx, v in by_id.items()}
    for i, idx in enumerate(index):
        scores[i] = scores[i] - mean[idx]
    tiled = scores.unsqueeze(-1).tile([1, mask.shape[-1]]) * mask
    return masked_whiten(tiled, mask) * mask


def trl_batch_scaled(rewards, group_size):
    """TRL's advantages with scale_rewards="batch" (sum_then_normalize, one reward function)."""
    mean_grouped = rewards.view(-1, group_size).mean(1).repeat_interleave(group_size)
    mean = rewards.mean()
    std = torch.sqrt(((rewards - mean) ** 2).mean() * len(rewards) / (len(rewards) - 1))
    return (rewards - mean_grouped) / (std + 1e-4)


# --- helpers --------------------------------------------------------------------------------------------------------
def random_step(seed=0, rows=7, width=6):
    """Unequal lengths: a random mask (first token kept), log-probs, pi_old, pi_behav, advantages, reference."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    logprobs = (torch.randn(rows, width, generator=g, dtype=torch.float64) - 2).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    behaviour = old + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width).contiguous()
    ref = torch.randn(rows, width, generator=g, dtype=torch.float64) - 2
    return mask, logprobs, old, behaviour, adv, ref


def rlsys_step(cfg, mask, logprobs, old, behaviour, adv, ref=None, parts=((0, 7),)):
    """The step's loss as the backend takes it: the micro-batches' shares summed, divided by the kept share; and
    the gradient of that."""
    losses, stats = [], {}
    for start, end in parts:
        rows = slice(start, end)
        loss, s = compute_loss(LossInputs(logprobs[rows], old[rows], behaviour[rows], adv[rows], mask[rows],
                                          float(mask.sum()), float(mask.shape[0]),
                                          None if ref is None else ref[rows]), cfg)
        losses.append(loss)
        for k, v in s.items():
            stats[k] = stats.get(k, 0.0) + v
    loss = sum(losses) / kept_share(stats, cfg)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad, stats


def reference_step(fn, logprobs):
    loss = fn(logprobs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad


def assert_same(ours, theirs):
    # float64 throughout; the bound is veRL's own epsilons (its / (tokens + 1e-8)): at most 1e-8 relative
    assert ours[0] == pytest.approx(theirs[0], rel=1e-7, abs=1e-12)
    assert torch.allclose(ours[1], theirs[1], rtol=1e-7, atol=1e-12)


PARTS = ((0, 1), (1, 5), (5, 7))  # 1, 4 and 2 sequences


# --- item 5: rejection leaves the counts, k1 as ratio bounds, seq_sum / seq_max --------------------------------------
REJECTIONS = [  # (rlsys trainer.mismatch, veRL's rollout_rs option and threshold)
    ({"reject": "k3", "reject_threshold": 0.05}, "token_k3", "0.05"),
    ({"reject": "k2", "reject_threshold": 0.04}, "token_k2", "0.04"),
    ({"reject": "k1", "reject_threshold": 1.3}, "token_k1", "1.3"),
    ({"reject": "k1", "reject_threshold": 1.4, "reject_threshold_low": 0.9}, "token_k1", "0.9_1.4"),
    ({"reject": "k1", "reject_threshold": 1.1, "level": "sequence"}, "seq_mean_k1", "1.1"),
    ({"reject": "k3", "reject_threshold": 0.05, "level": "sequence"}, "seq_mean_k3", "0.05"),
    ({"reject": "k1", "reject_threshold": 1.5, "reject_level": "seq_sum"}, "seq_sum_k1", "1.5"),
    ({"reject": "k2", "reject_threshold": 0.2, "reject_level": "seq_sum"}, "seq_sum_k2", "0.2"),
    ({"reject": "k3", "reject_threshold": 0.15, "reject_level": "seq_max"}, "seq_max_k3", "0.15"),
    ({"reject": "k2", "reject_threshold": 0.1, "reject_level": "seq_max"}, "seq_max_k2", "0.1"),
]


@pytest.mark.parametrize("mismatch, option, threshold", REJECTIONS, ids=[r[1] + "-" + r[2] for r in REJECTIONS])
@pytest.mark.parametrize("loss, mode", [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean")])
def test_rejection_matches_verl_with_the_rejected_tokens_out_of_the_counts(mismatch, option, threshold, loss, mode):
    mask, logprobs, old, behaviour, adv, _ = random_step()
    kept = verl_rejection_keep(old - behaviour, mask, option, threshold)
    assert 0 < kept.sum() < mask.sum(), "the case must reject some tokens and keep some"
    cfg = TrainerConfig(loss=loss, eps_high=0.2, mismatch=mismatch)
    theirs = reference_step(lambda lp: verl_vanilla(old, lp, adv, kept, mode), logprobs)
    for parts in [((0, 7),), PARTS]:
        loss_value, grad, stats = rlsys_step(cfg, mask, logprobs, old, behaviour, adv, parts=parts)
        assert_same((loss_value, grad), theirs)
    assert stats["mismatch_rejected_fraction"] == pytest.approx(1 - (kept.sum() / mask.sum()).item())


def test_without_the_kept_count_veRLs_loss_is_larger_by_the_rejected_share():
    # The case: a third of the tokens rejected makes veRL's loss 1.5 x one that keeps them in the count.
    inp = LossInputs(torch.zeros(1, 3, dtype=torch.float64, requires_grad=True), torch.zeros(1, 3, dtype=torch.float64),
                     torch.tensor([[-LN(4), 0.0, 0.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                     torch.ones(1, 3, dtype=torch.float64), 3.0, 1.0)
    cfg = TrainerConfig(mismatch={"reject": "k3", "reject_threshold": 0.5})
    loss, stats = compute_loss(inp, cfg)
    assert loss.item() == pytest.approx(-2 / 3) and kept_share(stats, cfg) == pytest.approx(2 / 3)
    assert loss.item() / kept_share(stats, cfg) == pytest.approx(-1.0)  # veRL's: the mean over the two kept


def test_sequence_k1_takes_the_signed_mean():
    # Token k1 = log(pi_behav / pi_old) = +0.5 and -0.5: a mean of 0 is kept at any bound, a mean of |k1| is not.
    mask = torch.ones(1, 2, dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    behaviour = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    inp = LossInputs(old.clone().requires_grad_(), old, behaviour, mask.clone(), mask, 2.0, 1.0)
    stats = compute_loss(inp, TrainerConfig(mismatch={"reject": "k1", "reject_threshold": 1.1,
                                                      "level": "sequence"}))[1]
    assert stats["mismatch_rejected_fraction"] == 0.0
    assert verl_rejection_keep(old - behaviour, mask, "seq_mean_k1", "1.1").sum() == 2


@pytest.mark.parametrize("mismatch, match", [
    ({"reject": "k1", "reject_threshold": 0.01}, r"lower bound must be below the upper"),
    ({"reject": "k1", "reject_level": "seq_max"}, r"no seq_max_k1"),
    ({"reject": "k3", "reject_threshold_low": 0.5}, r"reject_threshold_low is k1's lower ratio bound"),
    ({"reject_level": "seq_sum"}, r"need trainer.mismatch.reject"),
])
def test_rejection_settings_that_mean_nothing_are_refused(mismatch, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(mismatch=mismatch)


def test_the_backend_divides_the_steps_gradient_by_the_kept_share(model_dir):  # noqa: F811
    # The step's gradient norm with rejection is the planned-count gradient's over the share kept, exactly.
    groups = make_groups(3)
    for i, scored in enumerate(s for g in groups for s in g.samples):  # every other sample far from the trainer
        scored.completion.logprobs = [lp - 3.0 * (i % 2) for lp in scored.completion.logprobs]
    cfg = trainer_config(backend="torch", mismatch={"reject": "k3", "reject_threshold": 0.5}, grad_clip=0.0)
    samples = build_samples(groups, cfg.advantage)
    _, totals = plan_step(samples, 1, cfg.micro_batch_tokens)
    planned = TorchBackend(cfg, model_dir, SCORING)
    stats = planned.accumulate_gradients(samples, totals)
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in planned.model.parameters()
                         if p.grad is not None))
    share = kept_share(stats, cfg)
    assert 0.05 < share < 0.95, share  # the far samples' tokens go, the others stay
    metrics = TorchBackend(cfg, model_dir, SCORING).train_step(build_samples(groups, cfg.advantage), totals)
    assert metrics["grad_norm"] == pytest.approx(norm / share, rel=1e-5)
    assert metrics["loss"] == pytest.approx(stats["loss"] / share, rel=1e-9)


# --- item 5: GMPO's geometric weight, Dr.GRPO's normalisations, options a loss refuses, defaults -----------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gmpo_weights_a_sequence_by_the_geometric_mean_of_its_token_weights(level):
    mask, logprobs, old, behaviour, adv, _ = random_step(1)
    cfg = TrainerConfig(loss="gmpo", eps_low=0.4, mismatch={"mode": "tis", "threshold": 1.5, "level": level})
    log_rho = (old - behaviour) * mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    weights = torch.exp(log_rho.clamp(-20, 20)).clamp(max=1.5) * mask  # veRL's TIS weight, zero on padding
    theirs = reference_step(lambda lp: verl_geo_mean(old, lp, adv, mask, 0.4, 0.4, weights), logprobs)
    for parts in [((0, 7),), PARTS]:
        assert_same(rlsys_step(cfg, mask, logprobs, old, behaviour, adv, parts=parts)[:2], theirs)


def test_drgrpo_normalisations_are_veRLs_and_TRLs():
    mask, logprobs, old, behaviour, adv, _ = random_step(2)
    # token_sum_norm: veRL's agg_loss seq-mean-token-sum-norm (global-batch engine, one rank): sum / L.
    cfg = TrainerConfig(loss="drgrpo", loss_aggregation="token_sum_norm", loss_scale_tokens=9)
    ratio_loss = lambda lp: torch.maximum(-adv * torch.exp(lp - old),  # noqa: E731
                                          -adv * torch.exp(lp - old).clamp(0.8, 1.2))
    theirs = reference_step(lambda lp: verl_agg_loss(ratio_loss(lp), mask, "seq-mean-token-sum-norm", 9), logprobs)
    for parts in [((0, 7),), PARTS]:
        assert_same(rlsys_step(cfg, mask, logprobs, old, behaviour, adv, parts=parts)[:2], theirs)
    # seq_mean_token_sum_norm (drgrpo's own): TRL's dr_grpo, sum / (sequences x max_completion_length).
    cfg = TrainerConfig(loss="drgrpo", loss_scale_tokens=9)
    theirs = reference_step(lambda lp: (ratio_loss(lp) * mask).sum() / (mask.shape[0] * 9), logprobs)
    for parts in [((0, 7),), PARTS]:
        assert_same(rlsys_step(cfg, mask, logprobs, old, behaviour, adv, parts=parts)[:2], theirs)


@pytest.mark.parametrize("loss", ["cispo", "gmpo", "kl_cov", "sapo", "dg"])
@pytest.mark.parametrize("option, value", [("delta", 2.0), ("clip_ratio_c", 3.0)])
def test_ratio_caps_are_refused_where_the_loss_has_no_ppo_surrogate(loss, option, value):
    with pytest.raises(ConfigError, match=rf"trainer.{option}={value}: trainer.loss={loss} is not PPO's clipped "):
        load_config(None, [f"trainer.loss={loss}", f"trainer.{option}={value}"])


def test_both_caps_are_named_in_one_message():
    with pytest.raises(ConfigError, match=r"leave trainer.delta and trainer.clip_ratio_c out"):
        load_config(None, ["trainer.loss=cispo", "trainer.delta=2", "trainer.clip_ratio_c=3"])


@pytest.mark.parametrize("loss", ["grpo", "drgrpo", "gspo", "cispo", "gmpo", "clip_cov"])
def test_losses_default_to_veRLs_symmetric_clip(loss):
    from rlsys.trainer.losses import clip_range
    assert clip_range(TrainerConfig(loss=loss)) == (0.2, 0.2)  # veRL: clip_ratio_low = clip_ratio_high = 0.2
    assert TrainerConfig().kl_cov_coef == 0.1  # veRL's ppo_kl_coef


def test_cispo_by_default_is_veRLs():
    mask, logprobs, old, behaviour, adv, _ = random_step(3)

    def verl_cispo(lp):  # compute_policy_loss_cispo, clip_ratio 0.2 both sides, token-mean
        ratio = torch.exp((lp - old).clamp(-20, 20))
        return verl_agg_loss(-ratio.clamp(0.8, 1.2).detach() * adv * lp, mask, "token-mean")
    theirs = reference_step(verl_cispo, logprobs)
    for parts in [((0, 7),), PARTS]:
        assert_same(rlsys_step(TrainerConfig(loss="cispo"), mask, logprobs, old, behaviour, adv, parts=parts)[:2],
                    theirs)


# --- items 3 and 4: SAPO, KL estimators ---------------------------------------------------------------------------
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_matches_veRL_and_TRL(taus):
    mask, logprobs, old, behaviour, adv, _ = random_step(4)
    cfg = TrainerConfig(loss="sapo", sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    theirs = reference_step(lambda lp: verl_sapo(old, lp, adv, mask, *taus), logprobs)
    assert_same(reference_step(lambda lp: trl_sapo(old, lp, adv, mask, *taus), logprobs), theirs)
    for parts in [((0, 7),), PARTS]:
        assert_same(rlsys_step(cfg, mask, logprobs, old, behaviour, adv, parts=parts)[:2], theirs)


def test_sapo_by_default_trains_as_veRLs_and_TRLs_defaults():
    """trainer.loss=sapo alone gives their loss and gradient: the negative-advantage tokens' gate at tau_neg 1.05,
    fading faster than the positive ones' at tau_pos 1.0 (the test above sets the temperatures; this, the defaults)."""
    mask, logprobs, old, behaviour, adv, _ = random_step(4)
    assert (adv > 0).any() and (adv < 0).any()
    theirs = reference_step(lambda lp: verl_sapo(old, lp, adv, mask), logprobs)  # with veRL's default temperatures
    assert_same(rlsys_step(TrainerConfig(loss="sapo"), mask, logprobs, old, behaviour, adv)[:2], theirs)


def test_sapo_has_ppos_gradient_at_ratio_one_and_fades_away_from_it():
    # One token, A = 1: d loss / d log pi = -rho f'(rho) = -4 rho s (1 - s), s = sigmoid(tau (rho - 1)).
    for ratio in [1.0, 1.5, 3.0]:
        logprobs = torch.tensor([[LN(ratio)]], dtype=torch.float64, requires_grad=True)
        inp = LossInputs(logprobs, torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64),
                         torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), 1.0, 1.0)
        loss, _ = compute_loss(inp, TrainerConfig(loss="sapo"))
        (grad,) = torch.autograd.grad(loss, logprobs)
        s = 1 / (1 + math.exp(-(ratio - 1)))
        assert loss.item() == pytest.approx(-4 * s) and grad.item() == pytest.approx(-4 * ratio * s * (1 - s))
    assert -grad.item() / ratio < 0.5  # at rho 3 the gate's slope f'(rho) has faded below half PPO's (1, unclipped)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+"])
def test_kl_estimators_match_veRL_in_value_and_gradient(estimator):
    mask, logprobs, old, behaviour, adv, ref = random_step(5)
    ours = kl_penalty(logprobs, ref, estimator)
    theirs = verl_kl_penalty(logprobs, ref, estimator)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    weights = torch.rand(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g_ours, g_theirs = (torch.autograd.grad((x * weights).sum(), logprobs)[0] for x in (ours, theirs))
    assert torch.allclose(g_ours, g_theirs, rtol=1e-12, atol=1e-12)
    if estimator.endswith("+"):  # the straight-through gradient is k2's
        assert torch.allclose(g_ours, (logprobs - ref).detach() * weights, rtol=1e-12, atol=1e-12)


def test_a_kl_estimator_in_the_loss_sums_over_micro_batches():
    mask, logprobs, old, behaviour, adv, ref = random_step(6)
    cfg = TrainerConfig(kl={"estimator": "k3+", "coef": 0.1})
    whole = rlsys_step(cfg, mask, logprobs, old, behaviour, adv, ref)
    parts = rlsys_step(cfg, mask, logprobs, old, behaviour, adv, ref, PARTS)
    assert_same(parts[:2], whole[:2])


# --- items 3 and 4: advantages ------------------------------------------------------------------------------------
def lengths_and_rewards():
    lengths = [[3, 5, 1, 4], [2, 6, 6], [1]]  # unequal groups and lengths; a group of one
    rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 1.0], [0.7]]
    mask = torch.zeros(8, 6, dtype=torch.float64)
    for row, n in enumerate(n for group in lengths for n in group):
        mask[row, :n] = 1.0
    return lengths, rewards, mask


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_matches_veRL_on_unequal_lengths(name):
    lengths, rewards, mask = lengths_and_rewards()
    scores = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
    index = [g for g, group in enumerate(rewards) for _ in group]
    theirs = (verl_reinforce_pp(scores, mask) if name == "reinforce_pp" else
              verl_reinforce_pp_baseline(scores, mask, index))
    ours = [a for group in step_advantages(rewards, lengths, name) for a in group]
    # gamma 1 and one reward per sequence: every token of a sequence has the same advantage
    for row, adv in enumerate(ours):
        n = int(mask[row].sum())
        assert theirs[row, :n].tolist() == pytest.approx([adv] * n, rel=1e-7, abs=1e-12)  # veRL's 1e-8 epsilons


def test_grpo_batch_std_is_TRLs_scale_rewards_batch():
    rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.25, 1.0, 1.0]]
    theirs = trl_batch_scaled(torch.tensor([r for g in rewards for r in g], dtype=torch.float64), 4)
    ours = [a for g in step_advantages(rewards, [[1] * 4] * 2, "grpo_batch_std") for a in g]
    assert ours == pytest.approx(theirs.tolist(), rel=1e-12)
    assert group_advantages([0.3], "grpo_batch_std") == [0.0]


def test_batch_level_advantages_are_refused_when_streamed():
    with pytest.raises(ConfigError, match=r"trainer.advantage=reinforce_pp normalises by the whole step"):
        load_config(None, ["control.scheduler=tail", "trainer.streamed=true", "trainer.advantage=reinforce_pp"])


def completion(rid, n, finish):
    return Completion(rid, "p", [1, 2], [3] * n, [-0.5] * n, [0] * n, finish)


def test_truncated_completions_train_nothing_but_keep_their_place_in_the_advantages():
    group = Group(Prompt("p", "", ""), [ScoredSample(completion("a", 4, "length"), 1.0),
                                        ScoredSample(completion("b", 2, "stop"), 0.0),
                                        ScoredSample(completion("c", 3, "stop"), 0.5)])
    masked = build_samples([group], "drgrpo", mask_truncated=True)
    assert [s.advantage for s in masked] == pytest.approx([-0.5, 0.0])  # the mean is still (1 + 0 + 0.5) / 3
    assert [s.trained_tokens for s in masked] == [2, 3]
    assert len(build_samples([group], "drgrpo")) == 3
    # A batch-level estimator whitens over the tokens trained: the truncated one's are not among them.
    whitened = build_samples([group], "reinforce_pp", mask_truncated=True)
    assert sum(s.advantage * s.trained_tokens for s in whitened) == pytest.approx(0.0, abs=1e-12)


# --- item 3: the reference refreshed every N optimizer steps ---------------------------------------------------
def test_the_reference_is_mixed_towards_the_policy_every_n_updates(model_dir, tmp_path):  # noqa: F811
    kl = {"estimator": "k3", "coef": 0.1, "ref_sync_steps": 2, "ref_mixup_alpha": 0.6}
    backend = TorchBackend(trainer_config(backend="torch", kl=kl), model_dir, SCORING)
    initial = {n: p.detach().clone() for n, p in backend.reference.named_parameters()}

    def step(seed):
        samples = build_samples(make_groups(seed), "grpo")
        return backend.train_step(samples, plan_step(samples, 1, backend.cfg.micro_batch_tokens)[1])

    step(0)
    assert all(torch.equal(p, initial[n]) for n, p in backend.reference.named_parameters())  # one update: not yet
    step(1)
    policy = dict(backend.model.named_parameters())
    for name, ref in backend.reference.named_parameters():  # TRL's SyncRefModelCallback: ref (1 - a) + a policy
        want = initial[name] * (1 - 0.6) + policy[name].detach() * 0.6
        assert torch.allclose(ref, want, rtol=0, atol=1e-6), name
    assert any(not torch.equal(p, initial[n]) for n, p in backend.reference.named_parameters())
    # A checkpoint carries the refreshed reference and the update count: the next refresh is where it would be.
    backend.save(str(tmp_path))
    resumed = TorchBackend(trainer_config(backend="torch", kl=kl), model_dir, SCORING)
    resumed.load(str(tmp_path))
    assert resumed.updates == 2
    assert all(torch.equal(p, dict(backend.reference.named_parameters())[n])
               for n, p in resumed.reference.named_parameters())


def test_ref_sync_needs_a_kl_term():
    with pytest.raises(ValueError, match=r"trainer.kl.ref_sync_steps refreshes the reference of a KL term"):
        TrainerConfig(kl={"ref_sync_steps": 4})


# --- the same on DeepSpeed ranks: rejection's kept counts summed over ranks, the reference mixed under ZeRO ---------
def far_groups(seed):
    """make_groups, every other sample's behaviour log-probs 3 nats below: mismatch rejection takes those."""
    groups = make_groups(seed)
    for i, scored in enumerate(s for g in groups for s in g.samples):
        scored.completion.logprobs = [lp - 3.0 * (i % 2) for lp in scored.completion.logprobs]
    return groups


ROUND3 = dict(kl={"estimator": "k3+", "coef": 0.05, "ref_sync_steps": 1, "ref_mixup_alpha": 0.5},
              mismatch={"reject": "k3", "reject_threshold": 0.5}, loss="grpo")


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_deepspeed_ranks_match_the_torch_backend(model_dir, ray_cluster, zero_stage, tmp_path):  # noqa: F811
    from helpers import train_step, trainer_weights

    from rlsys.config import Config
    from rlsys.trainer.worker import TrainerGroup

    backend = TorchBackend(trainer_config(**ROUND3), model_dir, SCORING)
    want = []
    for seed in (0, 1, 2):
        samples = build_samples(far_groups(seed), "grpo")
        want.append(backend.train_step(samples, plan_step(samples, 1, backend.cfg.micro_batch_tokens)[1]))
    trainer = TrainerGroup(Config(trainer=trainer_config(backend="deepspeed", zero_stage=zero_stage, world_size=2,
                                                         **ROUND3)), model_dir, SCORING)
    try:
        got = [train_step(trainer, far_groups(seed)) for seed in (0, 1)]
        trainer.save(str(tmp_path))  # the refreshed reference goes with the checkpoint ...
        trainer.shutdown()
        trainer = TrainerGroup(Config(trainer=trainer_config(backend="deepspeed", zero_stage=zero_stage,
                                                             world_size=2, **ROUND3)), model_dir, SCORING)
        trainer.load(str(tmp_path))
        got.append(train_step(trainer, far_groups(2)))  # ... so the step after a resume is the same
        weights = trainer_weights(trainer)
    finally:
        trainer.shutdown()
    assert 0.05 < want[0]["mismatch_rejected_fraction"] < 0.95
    for x, y in zip(want, got):
        for key in ("loss", "grad_norm", "kl", "mismatch_rejected_fraction"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    ours = backend.state_dict_for_rollout()
    assert max((weights[k] - ours[k]).abs().max().item() for k in ours) < 3e-4


@pytest.mark.parametrize("loss, mismatch", [
    ("dapo", {"reject": "k3", "reject_threshold": 0.5}),  # the kept token count
    ("grpo", {"reject": "k3", "reject_threshold": 0.5, "level": "sequence"}),  # the kept sequence count
])
def test_a_streamed_step_with_rejection_equals_the_synchronous_step(model_dir, loss, mismatch):  # noqa: F811
    from test_streamed_training import assert_equivalent, step_groups, streamed_steps, sync_steps

    steps = step_groups([0, 1])
    for groups in steps:
        for i, scored in enumerate(s for g in groups for s in g.samples):
            scored.completion.logprobs = [lp - 3.0 * (i % 2) for lp in scored.completion.logprobs]
    cfg = trainer_config(loss=loss, mismatch=mismatch)
    sync_backend, streamed_backend = TorchBackend(cfg, model_dir, SCORING), TorchBackend(cfg, model_dir, SCORING)
    initial = sync_backend.state_dict_for_rollout()
    sync, streamed = sync_steps(sync_backend, steps), streamed_steps(streamed_backend, steps)
    assert_equivalent(sync, streamed, initial)
    name = "mismatch_rejected_fraction" if loss == "dapo" else "mismatch_rejected_sequence_fraction"
    assert 0.05 < sync[0][0][name] < 0.95
    assert streamed[0][0][name] == pytest.approx(sync[0][0][name], rel=1e-6)  # float32 sums of shares
