"""The options of issue 33 against values and gradients worked by hand from their papers: entropy bonus, CISPO,
GMPO, Clip-Cov and KL-Cov, the two-sided cap delta, bias-corrected KL, rejection sampling of the mismatch,
off-policy sequence masking and the top-entropy share; with unequal lengths, micro-batches and far ratios."""
import math

import pytest
import torch

from transformers import AutoModelForCausalLM

from rlsys.config import Config, ConfigError, TrainerConfig
from rlsys.startup import load_config
from rlsys.trainer.advantages import KLController
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.logprobs import token_logprobs
from rlsys.trainer.losses import LossInputs, compute_loss
from rlsys.trainer.worker import TrainerGroup

from helpers import train_step

from test_trainer import SCORING, TEMPERATURE, make_groups, model_dir, trainer_config  # noqa: F401

LN = math.log


def tensor(x):
    return torch.tensor(x, dtype=torch.float64)


def inputs(logprobs, old=None, behaviour=None, adv=None, mask=None, entropy=None):
    """[B, T] float64 inputs: pi_old defaults to pi (on-policy), pi_behav to pi_old, A and the mask to ones."""
    logprobs = tensor(logprobs).requires_grad_()
    old = logprobs.detach().clone() if old is None else tensor(old)
    behaviour = old.clone() if behaviour is None else tensor(behaviour)
    adv = torch.ones_like(old) if adv is None else tensor(adv)
    mask = torch.ones_like(old) if mask is None else tensor(mask)
    entropy = None if entropy is None else tensor(entropy).requires_grad_()
    return LossInputs(logprobs, old, behaviour, adv, mask, float(mask.sum()), float(mask.shape[0]), entropy=entropy)


def run(inp, **cfg):
    loss, stats = compute_loss(inp, TrainerConfig(**cfg))
    wrt = [inp.logprobs] + ([inp.entropy] if inp.entropy is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)  # the entropy is unused without a bonus
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads)]
    return loss.item(), [g.flatten().tolist() for g in grads], stats


# --- entropy bonus ---------------------------------------------------------------------------------
def test_entropy_bonus_subtracts_the_aggregated_entropy_and_pushes_it_up():
    # dapo (token_mean) on-policy, A = 1 on two tokens of one sequence and one of another (its padding masked).
    inp = inputs([[-1.0, -2.0], [-1.0, -5.0]], adv=[[1.0, 1.0], [-1.0, -1.0]], mask=[[1, 1], [1, 0]],
                 entropy=[[0.5, 1.5], [1.0, 9.0]])
    loss, (grad_lp, grad_h), stats = run(inp, entropy_coeff=0.1)
    assert loss == pytest.approx((-1 - 1 + 1) / 3 - 0.1 * (0.5 + 1.5 + 1.0) / 3)
    assert grad_h == pytest.approx([-0.1 / 3, -0.1 / 3, -0.1 / 3, 0.0])
    assert grad_lp == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0.0])
    assert stats["entropy"] == pytest.approx(1.0)  # token mean of 0.5, 1.5, 1.0
    # Under grpo's seq_mean_token_mean the bonus is aggregated the same way as the loss.
    loss = run(inputs([[-1.0, -2.0], [-1.0, -5.0]], adv=[[0.0, 0.0], [0.0, 0.0]], mask=[[1, 1], [1, 0]],
                      entropy=[[0.5, 1.5], [1.0, 9.0]]), loss="grpo", entropy_coeff=0.1)[0]
    assert loss == pytest.approx(-0.1 * ((0.5 + 1.5) / 2 + 1.0) / 2)


def test_entropy_options_need_the_entropy():
    with pytest.raises(ValueError, match="trainer.entropy_coeff and trainer.top_entropy_share need the entropy"):
        run(inputs([[-1.0]]), entropy_coeff=0.1)


# --- CISPO -----------------------------------------------------------------------------------------
def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # Ratios 2, 1/2, 1.1 with A = 1, -1, 1; eps 0.2 / 0.28: weights 1.28, 0.8, 1.1 (sg), loss -w A log pi.
    logprobs = [[LN(2) - 1, LN(0.5) - 1, LN(1.1) - 1]]
    inp = inputs(logprobs, old=[[-1.0, -1.0, -1.0]], adv=[[1.0, -1.0, 1.0]])
    loss, (grad,), stats = run(inp, loss="cispo", eps_high=0.28)
    w, a = [1.28, 0.8, 1.1], [1.0, -1.0, 1.0]
    assert loss == pytest.approx(sum(-wi * ai * lp for wi, ai, lp in zip(w, a, logprobs[0])) / 3)
    assert grad == pytest.approx([-wi * ai / 3 for wi, ai in zip(w, a)])  # PPO would give the first two none
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    # eps_low 1 (the paper's one-sided clip): the weight 1/2 is kept.
    assert run(inp, loss="cispo", eps_low=1.0, eps_high=0.28)[1][0][1] == pytest.approx(0.5 / 3)


# --- GMPO ------------------------------------------------------------------------------------------
def test_gmpo_takes_the_geometric_mean_of_sign_clipped_token_ratios():
    # Sequence 0: token log-ratios 0.1 and 0.6, A = 1, eps 0.4: 0.6 is clipped to 0.4 and loses its gradient;
    # ratio exp((0.1 + 0.4) / 2). Sequence 1: one token, log-ratio -0.6, A = -1: clipped to -0.4 (no gradient).
    inp = inputs([[0.1, 0.6], [-0.6, 3.0]], old=[[0.0, 0.0], [0.0, 0.0]], adv=[[1.0, 1.0], [-1.0, -1.0]],
                 mask=[[1, 1], [1, 0]])
    loss, (grad,), stats = run(inp, loss="gmpo", eps_low=0.4)
    assert loss == pytest.approx((-math.exp(0.25) + math.exp(-0.4)) / 2)
    assert grad == pytest.approx([-math.exp(0.25) / 2 / 2, 0.0, 0.0, 0.0])
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    # The other way round the clip does not bind: A = -1 on 0.1, 0.6 keeps both tokens' gradients.
    inp = inputs([[0.1, 0.6]], old=[[0.0, 0.0]], adv=[[-1.0, -1.0]])
    loss, (grad,), _ = run(inp, loss="gmpo", eps_low=0.4)
    assert loss == pytest.approx(math.exp(0.35)) and grad == pytest.approx([math.exp(0.35) / 2] * 2)


# --- Clip-Cov and KL-Cov ---------------------------------------------------------------------------------
# Four tokens on-policy; advantages 2, 2, -2, -2 (mean 0) and log-probs -1, -3, -1.5, -3 (mean -2.125):
# covariance 2.25, -1.75, -1.25, 1.75. One token in four is picked (cov_ratio 0.25).
COV = dict(logprobs=[[-1.0, -3.0], [-1.5, -3.0]], adv=[[2.0, 2.0], [-2.0, -2.0]])


def test_clip_cov_removes_the_gradient_of_the_highest_covariance_token_within_the_bounds():
    inp = inputs(COV["logprobs"], adv=COV["adv"])
    loss, (grad,), stats = run(inp, loss="clip_cov", cov_ratio=0.25, clip_cov_bounds=(1.0, 5.0))
    # Token 0 has the highest covariance, 2.25: its loss and gradient are zeroed.
    assert grad == pytest.approx([0.0, -2 / 4, 2 / 4, 2 / 4]) and loss == pytest.approx((0 - 2 + 2 + 2) / 4)
    assert stats["cov_picked_fraction"] == pytest.approx(1 / 4)
    # Token 0 outside the bounds: the next inside them, token 3 (1.75), is picked; none inside: it is dapo.
    assert run(inp, loss="clip_cov", cov_ratio=0.25, clip_cov_bounds=(1.0, 2.0))[1][0] == pytest.approx(
        [-0.5, -0.5, 0.5, 0.0])
    assert run(inp, loss="clip_cov", cov_ratio=0.25, clip_cov_bounds=(3.0, 5.0))[1][0] == pytest.approx(
        [-0.5, -0.5, 0.5, 0.5])


def test_kl_cov_adds_an_abs_log_ratio_penalty_on_the_highest_covariance_token():
    # Token 0 moved: log ratio 0.5 (ratio e^0.5, no clip in KL-Cov); covariance still highest there.
    inp = inputs(COV["logprobs"], old=[[-1.5, -3.0], [-1.5, -3.0]], adv=COV["adv"])
    loss, (grad,), stats = run(inp, loss="kl_cov", cov_ratio=0.25, kl_cov_coef=2.0)
    r = math.exp(0.5)
    assert loss == pytest.approx((-2 * r + 2 * 0.5 - 2 + 2 + 2) / 4)
    assert grad == pytest.approx([(-2 * r + 2.0) / 4, -2 / 4, 2 / 4, 2 / 4])
    assert stats["cov_picked_fraction"] == pytest.approx(1 / 4)


def test_covariance_picks_are_per_micro_batch():
    # As veRL's: the means and the count are the micro-batch's, so a row alone picks its own token.
    inp = inputs(COV["logprobs"], adv=COV["adv"])
    cfg = TrainerConfig(loss="kl_cov", cov_ratio=0.25)
    row = LossInputs(inp.logprobs[1:], inp.old_logprobs[1:], inp.behaviour_logprobs[1:], inp.advantages[1:],
                     inp.mask[1:], 4.0, 2.0)
    assert compute_loss(row, cfg)[1]["cov_picked_fraction"] == pytest.approx(1 / 4)


def test_eps_high_is_refused_by_kl_cov():
    with pytest.raises(ConfigError, match="trainer.loss=kl_cov clips no ratio"):
        load_config(None, ["trainer.loss=kl_cov", "trainer.eps_high=0.3"])


# --- delta and bias-corrected KL ---------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, adv, loss, grad", [
    (3.0, -1.0, 2.0, 0.0),    # A < 0 past delta: -A delta, no gradient
    (1.5, -1.0, 1.5, 1.5),    # below delta: the usual -rho A
    (3.0, 1.0, -1.28, 0.0),   # A > 0: the upper clip, as without delta
])
@pytest.mark.parametrize("loss_name", ["dapo", "grpo", "gspo", "decoupled_ppo"])
def test_delta_caps_the_unclipped_ratio(loss_name, ratio, adv, loss, grad):
    got = run(inputs([[LN(ratio)]], old=[[0.0]], adv=[[adv]]), loss=loss_name, delta=2.0, eps_high=0.28)
    assert got[0] == pytest.approx(loss) and got[1][0] == pytest.approx([grad])


def test_bias_corrected_kl_is_the_kl_times_the_ratio_with_its_gradient():
    # log pi = -1, pi_old: -1 - ln 2 (ratio 2), pi_ref: -2; k3 = e^-1 - 1 + 1 = e^-1, d k3 / d log pi = 1 - e^-1.
    inp = inputs([[-1.0]], old=[[-1.0 - LN(2)]], adv=[[0.0]])
    inp.ref_logprobs = torch.tensor([[-2.0]], dtype=torch.float64)
    loss, (grad,), stats = run(inp, kl={"estimator": "k3", "coef": 0.5, "bias_correction": True})
    k3, dk3 = math.exp(-1), 1 - math.exp(-1)
    assert loss == pytest.approx(0.5 * 2 * k3) and stats["kl"] == pytest.approx(2 * k3)
    assert grad == pytest.approx([0.5 * (2 * dk3 + 2 * k3)])
    assert run(inp, kl={"estimator": "k3", "coef": 0.5})[0] == pytest.approx(0.5 * k3)


# --- rejection sampling of the mismatch --------------------------------------------------------------------
# On-policy for the trainer, A = 1, rho = pi_old / pi_behav = 4, 1/2, 1 (log rho = ln 4, -ln 2, 0).
RHO_LOGS = [LN(4), -LN(2), 0.0]


def rejected(**mismatch):
    inp = inputs([[0.0] * 3], old=[[0.0] * 3], behaviour=[[-x for x in RHO_LOGS]])
    return run(inp, mismatch=mismatch)


@pytest.mark.parametrize("estimator, values", [
    ("k2", [0.5 * LN(4) ** 2, 0.5 * LN(2) ** 2, 0.0]),
    ("k3", [4 - 1 - LN(4), 0.5 - 1 + LN(2), 0.0]),                   # rho - 1 - log rho
])
def test_token_rejection_drops_tokens_whose_kl_estimate_is_above_the_threshold(estimator, values):
    threshold = (sorted(values)[1] + sorted(values)[2]) / 2  # between the two largest: only the largest goes
    loss, (grad,), stats = rejected(reject=estimator, reject_threshold=threshold)
    keep = [v <= threshold for v in values]
    assert grad == pytest.approx([-1 / 3 if k else 0.0 for k in keep]) and sum(keep) == 2
    assert stats["mismatch_corrected_fraction"] == pytest.approx(1 / 3)


def test_sequence_rejection_drops_the_whole_sequence_on_its_mean_estimate():
    # k2 mean over the sequence = (0.96 + 0.24 + 0) / 3 = 0.40: rejected at 0.3, kept at 0.5.
    mean = (0.5 * LN(4) ** 2 + 0.5 * LN(2) ** 2) / 3
    assert rejected(reject="k2", level="sequence", reject_threshold=mean - 0.1)[1][0] == [0.0] * 3
    assert rejected(reject="k2", level="sequence", reject_threshold=mean + 0.1)[1][0] == pytest.approx([-1 / 3] * 3)


def test_rejection_combines_with_a_weight_and_takes_the_trainers_own_pi_old():
    # tis at 2 weights 2, 1/2, 1; k1 within the ratio bounds [2/3, 3/2] of pi_behav / pi_old rejects the first two.
    loss, (grad,), _ = rejected(mode="tis", threshold=2.0, reject="k1", reject_threshold=1.5)
    assert grad == pytest.approx([0.0, 0.0, -1 / 3])
    cfg = TrainerConfig(mismatch={"reject": "k3"})
    assert cfg.mismatch.active and not TrainerConfig().mismatch.active
    with pytest.raises(ValueError, match="trainer.mismatch.mode=none, reject=k3: trainer.loss=ppo_naive"):
        run(inputs([[0.0]]), loss="ppo_naive", mismatch={"reject": "k3"})


# --- off-policy sequence masking and the top-entropy share ---------------------------------------------------
def test_off_policy_mask_drops_negative_sequences_that_drifted():
    # Three sequences, mean log(pi_behav / pi) = 0.3, 0.3, 0.05: the first (A < 0) is dropped at delta 0.1;
    # the second has A > 0 and stays, the third has not drifted enough.
    logprobs = [[-1.3, -1.3], [-1.3, -1.3], [-1.05, -1.05]]
    inp = inputs(logprobs, behaviour=[[-1.0, -1.0]] * 3, adv=[[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    loss, (grad,), stats = run(inp, off_policy_mask=0.1)
    assert grad == pytest.approx([0.0, 0.0, -1 / 6, -1 / 6, 1 / 6, 1 / 6])
    assert stats["off_policy_masked"] == pytest.approx(2 / 6)


def test_top_entropy_share_trains_only_the_high_entropy_tokens():
    # Entropies 0.1, 0.5, 0.9, 0.3 (one padding 9.0 masked): share 0.5 keeps tokens at or above the median 0.4.
    inp = inputs([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], mask=[[1, 1, 1], [1, 0, 0]],
                 entropy=[[0.1, 0.5, 0.9], [0.3, 9.0, 9.0]])
    loss, (grad, _), stats = run(inp, top_entropy_share=0.5)
    assert grad == pytest.approx([0.0, -1 / 4, -1 / 4, 0.0, 0.0, 0.0])
    assert stats["low_entropy_dropped"] == pytest.approx(2 / 4)


# --- micro-batches and far ratios, across the options --------------------------------------------------------
OPTIONS = [
    {"loss": "cispo"}, {"loss": "gmpo", "eps_low": 0.4}, {"loss": "dapo", "delta": 1.5},
    {"loss": "grpo", "entropy_coeff": 0.05},
    {"loss": "dapo", "kl": {"estimator": "k3", "coef": 0.1, "bias_correction": True}},
    {"loss": "dapo", "mismatch": {"reject": "k3", "reject_threshold": 0.05}},
    {"loss": "gspo", "mismatch": {"reject": "k2", "level": "sequence", "reject_threshold": 0.05}},
    {"loss": "dapo", "off_policy_mask": 0.05},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_unequal_micro_batches_sum_to_the_step(options):
    torch.manual_seed(0)
    mask = (torch.rand(7, 6) > 0.3).double()
    mask[:, 0] = 1.0
    logprobs = (torch.randn(7, 6, dtype=torch.float64) - 2).requires_grad_()
    entropy = torch.rand(7, 6, dtype=torch.float64).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(7, 6, dtype=torch.float64)
    behaviour = old + 0.3 * torch.randn(7, 6, dtype=torch.float64)
    adv = torch.randn(7, 1, dtype=torch.float64).expand(7, 6).contiguous()
    ref = torch.randn(7, 6, dtype=torch.float64) - 2
    cfg = TrainerConfig(**options)

    def share(rows):
        return compute_loss(LossInputs(logprobs[rows], old[rows], behaviour[rows], adv[rows], mask[rows],
                                       float(mask.sum()), 7.0, ref[rows], entropy=entropy[rows]), cfg)

    whole, stats = share(slice(0, 7))
    whole_grads = torch.autograd.grad(whole, [logprobs, entropy], allow_unused=True)
    parts = [share(slice(0, 1)), share(slice(1, 5)), share(slice(5, 7))]
    parts_grads = torch.autograd.grad(sum(p[0] for p in parts), [logprobs, entropy], allow_unused=True)
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=1e-9)
    for w, p in zip(whole_grads, parts_grads):
        assert (w is None and p is None) or torch.allclose(w, p, rtol=1e-9, atol=1e-12)
    for key in stats:
        assert sum(p[1][key] for p in parts) == pytest.approx(stats[key], rel=1e-9, abs=1e-12), key
    assert any(v > 0 for k, v in stats.items() if k.endswith("fraction") or k.endswith("masked")) or \
        options["loss"] == "cispo" or "entropy_coeff" in options or "kl" in options  # the option acted


PER_MICRO_BATCH = [{"loss": "clip_cov", "cov_ratio": 0.5}, {"loss": "kl_cov", "cov_ratio": 0.5},
                   {"loss": "dapo", "top_entropy_share": 0.5}]  # exact within a micro-batch only (design.md)


@pytest.mark.parametrize("options", OPTIONS + PER_MICRO_BATCH, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_far_ratios_stay_finite_under_every_option(options):
    # pi / pi_old and pi_old / pi_behav e^(+-100) on one token each.
    inp = inputs([[-1.0, -1.0], [-1.0, -1.0]], old=[[-101.0, -1.0], [99.0, -1.0]],
                 behaviour=[[-1.0, -101.0], [-1.0, -1.0]], adv=[[-1.0, -1.0], [1.0, 1.0]],
                 entropy=[[1.0, 2.0], [0.5, 0.1]])
    inp.ref_logprobs = torch.tensor([[-100.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, grads, _ = run(inp, **options)
    assert math.isfinite(loss) and all(math.isfinite(g) for grad in grads for g in grad)


# --- KL in the reward with an adaptive controller -------------------------------------------------------------
def test_the_adaptive_controller_moves_the_coefficient_by_the_clipped_error():
    c = KLController(0.1, target=0.02, horizon=1000)
    c.update(0.03, 100)  # error 0.5 clipped to 0.2: x (1 + 0.2 x 100 / 1000)
    assert c.coef == pytest.approx(0.1 * 1.02)
    c.update(0.018, 500)  # error -0.1: x (1 - 0.1 x 0.5)
    assert c.coef == pytest.approx(0.1 * 1.02 * 0.95)
    fixed = KLController(0.1, target=None, horizon=1000)
    fixed.update(5.0, 100)
    assert fixed.coef == 0.1


def test_penalties_come_off_the_rewards_before_the_advantages():
    groups = make_groups(3, prompts=1, group_size=3)
    groups[0].samples[1].completion.token_ids = []  # an empty response: no sample, no penalty, still in the group
    rewards = groups[0].rewards
    samples = build_samples(groups, "drgrpo", penalties=[0.5, 0.25])
    penalised = [rewards[0] - 0.5, rewards[1], rewards[2] - 0.25]
    mean = sum(penalised) / 3
    assert [s.advantage for s in samples] == pytest.approx([penalised[0] - mean, penalised[2] - mean])


def test_kl_in_the_reward_is_not_in_the_loss_and_needs_an_estimator():
    inp = inputs([[-1.0]], adv=[[0.0]])
    inp.ref_logprobs = torch.tensor([[-3.0]], dtype=torch.float64)
    assert "kl" not in run(inp, kl={"estimator": "k1", "coef": 0.1, "in_reward": True})[2]
    with pytest.raises(ValueError, match="trainer.kl.in_reward and trainer.kl.target need trainer.kl.estimator"):
        TrainerConfig(kl={"in_reward": True})
    with pytest.raises(ValueError, match="trainer.kl.target adapts the KL coefficient in the reward"):
        TrainerConfig(kl={"estimator": "k1", "coef": 0.1, "target": 0.1})


def test_the_backend_sums_each_samples_kl_to_the_reference(model_dir):  # noqa: F811
    cfg = trainer_config(backend="torch", kl={"estimator": "k2", "coef": 0.1, "in_reward": True})
    backend = TorchBackend(cfg, model_dir, SCORING)
    samples = build_samples(make_groups(1, prompts=2, group_size=2), "grpo")
    for sample in samples[::2]:  # multi-turn: a tool's output inside the response (mask 0), the model's around it
        n = len(sample.logprobs)
        sample.mask = [0 if n // 3 <= i < n - 1 else 1 for i in range(n)]
    assert any(s.mask and 0 in s.mask for s in samples)
    got = backend.sequence_kl(samples, 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for sample, kl in zip(samples, got):
        ids = torch.tensor([sample.input_ids])
        with torch.no_grad():
            ref = token_logprobs(model(input_ids=ids).logits, ids, SCORING)[0, sample.prompt_len - 1:]
        behaviour = torch.tensor(sample.logprobs)
        model_tokens = torch.tensor(sample.mask or [1] * len(sample.logprobs))  # a tool's tokens: no KL
        assert kl == pytest.approx((0.5 * (ref - behaviour) ** 2 * model_tokens).sum().item(), rel=1e-4)


def test_a_step_with_kl_in_the_reward_reports_and_adapts_the_coefficient(model_dir, ray_cluster):  # noqa: F811
    kl = {"estimator": "k1", "coef": 0.1, "in_reward": True, "target": 1e-6, "horizon": 16}
    trainer = TrainerGroup(Config(trainer=trainer_config(backend="torch", kl=kl)), model_dir, SCORING)
    try:
        first = train_step(trainer, make_groups(0), version=0)
        second = train_step(trainer, make_groups(1), version=1)
    finally:
        trainer.shutdown()
    # The behaviour log-probs (-log V) are far from the model's: the KL is well above the target, so after a
    # step of 16 sequences the coefficient grows by the capped 20% x 16 / 16.
    assert first["reward_kl"] > 1e-3 and first["reward_kl_coef"] == pytest.approx(0.1)
    assert second["reward_kl_coef"] == pytest.approx(0.1 * 1.2)
    assert "kl" not in first


def test_the_adapted_coefficient_is_saved_with_a_checkpoint(model_dir, ray_cluster, tmp_path):  # noqa: F811
    kl = {"estimator": "k1", "coef": 0.1, "in_reward": True, "target": 1e-6, "horizon": 16}
    trainer = TrainerGroup(Config(trainer=trainer_config(backend="torch", kl=kl)), model_dir, SCORING)
    try:
        train_step(trainer, make_groups(0), version=0)
        trainer.save(str(tmp_path))
        trainer.kl_in_reward.coef = 0.1
        trainer.load(str(tmp_path))
        assert trainer.kl_in_reward.coef == pytest.approx(0.12)
    finally:
        trainer.shutdown()


def test_the_entropy_bonus_reaches_the_weights_as_a_plain_forward_computes_it(model_dir):  # noqa: F811
    # Every reward equal: zero advantages, so the step's whole gradient is the bonus -c H, token mean.
    groups = make_groups(0)
    for group in groups:
        for s in group.samples:
            s.reward = 1.0
    cfg = trainer_config(backend="torch", entropy_coeff=0.5, micro_batch_tokens=40)
    backend = TorchBackend(cfg, model_dir, SCORING)
    samples = build_samples(groups, cfg.advantage)
    _, totals = plan_step(samples, 1, cfg.micro_batch_tokens)
    backend.accumulate_gradients(samples, totals)
    got = {n: p.grad for n, p in backend.model.named_parameters()}

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    bonus = 0.0
    for s in samples:  # one sequence alone, full logits: position t scores token t + 1
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0, s.prompt_len - 1:-1] / TEMPERATURE
        logp = logits.log_softmax(-1)
        bonus = bonus - 0.5 * -(logp.exp() * logp).sum() / totals.tokens
    bonus.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-5
    assert max(g.abs().max().item() for g in want.values()) > 1e-4  # the comparison is not vacuous
