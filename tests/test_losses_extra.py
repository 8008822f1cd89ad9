"""Mismatch correction, dual-clip, aggregation by name, Dr.GRPO and GSPO against hand-computed values and
gradients; the conventions (clamps); recipes; the mismatch warning through a real trainer group."""
import logging
import math
from pathlib import Path

import pytest
import torch

from rlsys.config import CONFIG_DIR, Config, ConfigError, TrainerConfig
from rlsys.startup import load_config
from rlsys.trainer.losses import (AGGREGATIONS, LOG_RATIO_BOUND, POLICY_LOSSES, LossInputs,
                                  clip_range, compute_loss, kl_penalty)
from rlsys.trainer.worker import TrainerGroup

from helpers import train_step

from test_trainer import SCORING, make_groups, model_dir, trainer_config  # noqa: F401

LN = math.log


def inputs(logprobs, old, behaviour, adv, mask=None):
    logprobs = torch.tensor(logprobs, requires_grad=True)
    mask = torch.ones_like(logprobs) if mask is None else torch.tensor(mask)
    return LossInputs(logprobs, torch.tensor(old), torch.tensor(behaviour), torch.tensor(adv), mask,
                      float(mask.sum()), float(mask.shape[0]), start_logprobs=torch.tensor(old))


def loss_and_grad(inp, **cfg):
    loss, stats = compute_loss(inp, TrainerConfig(**cfg))
    (grad,) = torch.autograd.grad(loss, inp.logprobs)
    return loss.item(), grad.flatten().tolist(), stats


# --- dual-clip ------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_name", ["dapo", "grpo", "decoupled_ppo", "gspo"])
def test_dual_clip_bounds_negative_advantages(loss_name):
    # ratio 4, A = -1: the surrogate loses 4 with gradient 4; dual-clip at c = 3 loses 3 with none.
    far = inputs([[LN(4)]], [[0.0]], [[0.0]], [[-1.0]])
    assert loss_and_grad(far, loss=loss_name)[:2] == (pytest.approx(4.0), [pytest.approx(4.0)])
    loss, grad, stats = loss_and_grad(far, loss=loss_name, clip_ratio_c=3.0)
    assert loss == pytest.approx(3.0) and grad == [0.0] and stats["clip_fraction_dual"] == 1.0
    assert stats["clip_fraction"] == 1.0
    # Below c, or with A > 0, dual-clip changes nothing.
    near = inputs([[LN(2)]], [[0.0]], [[0.0]], [[-1.0]])
    assert loss_and_grad(near, loss=loss_name, clip_ratio_c=3.0)[:2] == (pytest.approx(2.0), [pytest.approx(2.0)])
    positive = inputs([[LN(4)]], [[0.0]], [[0.0]], [[1.0]])
    assert loss_and_grad(positive, loss=loss_name, clip_ratio_c=3.0)[1] == [0.0]  # the usual upper clip


# --- aggregation by name --------------------------------------------------------------------------
# On-policy, per-token loss -A: sequence 0 has 1 token (A = 1), sequence 1 has 3 (A = -1).
AGG_MASK = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
AGG_ADV = [[1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]


@pytest.mark.parametrize("aggregation, loss, grad", [
    ("token_mean", (-1 + 3) / 4, [-1 / 4, 0, 0] + [1 / 4] * 3),
    ("seq_mean_token_mean", (-1 + 1) / 2, [-1 / 2, 0, 0] + [1 / 6] * 3),
    ("seq_mean_token_sum", (-1 + 3) / 2, [-1 / 2, 0, 0] + [1 / 2] * 3),
    ("seq_mean_token_sum_norm", (-1 + 3) / (2 * 4), [-1 / 8, 0, 0] + [1 / 8] * 3),  # constant 4
])
def test_aggregations_by_name(aggregation, loss, grad):
    zeros = [[0.0] * 3] * 2
    inp = inputs(zeros, zeros, zeros, AGG_ADV, AGG_MASK)
    got = loss_and_grad(inp, loss="grpo", loss_aggregation=aggregation, loss_scale_tokens=4)
    assert got[0] == pytest.approx(loss) and got[1] == pytest.approx(grad)


def test_drgrpo_loss_divides_by_the_constant_not_the_length():
    zeros = [[0.0] * 3] * 2
    inp = inputs(zeros, zeros, zeros, AGG_ADV, AGG_MASK)
    assert loss_and_grad(inp, loss="drgrpo", loss_scale_tokens=4)[0] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="trainer.loss_scale_tokens"):
        compute_loss(inp, TrainerConfig(loss="drgrpo"))  # a bare TrainerConfig: no rollout to take it from


def test_the_dr_grpo_constant_defaults_to_the_longest_response():
    cfg = load_config(None, ["rollout.max_new_tokens=77"])
    assert cfg.trainer.loss_scale_tokens == 77
    assert load_config(None, ["trainer.loss_scale_tokens=500"]).trainer.loss_scale_tokens == 500


MISMATCHES = [{}, {"mode": "tis"}, {"mode": "mis", "level": "sequence", "threshold": 1.5}]


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
@pytest.mark.parametrize("loss_name", ["grpo", "dapo", "decoupled_ppo", "gspo", "drgrpo", "dg_clipped"])
@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_unequal_micro_batches_sum_to_the_step_in_value_and_gradient(aggregation, loss_name, mismatch):
    torch.manual_seed(0)
    mask = (torch.rand(7, 6) > 0.3).float()
    mask[:, 0] = 1.0
    logprobs = (torch.randn(7, 6) - 2).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(7, 6)
    behaviour = old + 0.3 * torch.randn(7, 6)
    adv = torch.randn(7, 1).expand(7, 6).contiguous()
    cfg = TrainerConfig(loss=loss_name, loss_aggregation=aggregation, loss_scale_tokens=9, clip_ratio_c=1.5,
                        mismatch=mismatch, kl={"estimator": "k2", "coef": 0.05})
    ref = torch.randn(7, 6) - 2

    def share(rows):  # the step's totals, this micro-batch's rows
        return compute_loss(LossInputs(logprobs[rows], old[rows], behaviour[rows], adv[rows], mask[rows],
                                       float(mask.sum()), 7.0, ref[rows]), cfg)

    whole, whole_stats = share(slice(0, 7))
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    parts = [share(slice(0, 1)), share(slice(1, 5)), share(slice(5, 7))]  # 1, 4 and 2 sequences
    (parts_grad,) = torch.autograd.grad(sum(p[0] for p in parts), logprobs)
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=1e-5)
    assert torch.allclose(parts_grad, whole_grad, rtol=1e-5, atol=1e-7)
    for key in whole_stats:
        assert sum(p[1][key] for p in parts) == pytest.approx(whole_stats[key], rel=1e-5, abs=1e-8), key


# --- GSPO -----------------------------------------------------------------------------------------
# Sequence 0: token ratios 2 and 1, so s = sqrt(2). Sequence 1: one token, ratio 1/2 (its padding is junk).
GSPO = dict(logprobs=[[LN(2), 0.0], [LN(0.5), 7.0]], old=[[0.0, 0.0], [0.0, -9.0]], mask=[[1.0, 1.0], [1.0, 0.0]])


def gspo(adv, **cfg):
    g = GSPO
    return loss_and_grad(inputs(g["logprobs"], g["old"], g["old"], adv, g["mask"]), loss="gspo", **cfg)


def test_gspo_ratio_is_the_geometric_mean_and_its_gradient_is_shared():
    s = math.sqrt(2)
    loss, grad, stats = gspo([[1.0, 1.0], [1.0, 0.0]], eps_low=0.6, eps_high=0.5)
    assert loss == pytest.approx((-s - 0.5) / 2)
    # d(-s)/d log pi_t = -s / |y| for both tokens of sequence 0 (a token-level ratio would give -2 and -1).
    assert grad == pytest.approx([-s / 2 / 2, -s / 2 / 2, -0.5 / 2, 0.0])
    assert stats["clip_fraction"] == 0.0


def test_gspo_clips_whole_sequences():
    # eps_high 0.2: sequence 0 (s = 1.41, A > 0) is clipped on both tokens; sequence 1 (s = 0.5, A > 0) is not.
    loss, grad, stats = gspo([[1.0, 1.0], [1.0, 0.0]], eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx((-1.2 - 0.5) / 2) and grad == pytest.approx([0.0, 0.0, -0.25, 0.0])
    assert stats["clip_fraction_high"] == pytest.approx(2 / 3)
    # A < 0: sequence 1 (s = 0.5 < 0.8) is clipped below, sequence 0 keeps its gradient s / |y|.
    loss, grad, stats = gspo([[-1.0, -1.0], [-1.0, 0.0]], eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx((math.sqrt(2) + 0.8) / 2)
    assert grad == pytest.approx([math.sqrt(2) / 4, math.sqrt(2) / 4, 0.0, 0.0])
    assert stats["clip_fraction_low"] == pytest.approx(1 / 3)


def test_gspo_clamps_the_sequence_log_ratio_at_10_with_no_gradient_beyond():
    # Two tokens at log ratio 12 (each inside the token bound of 20): log s = 12 is clamped to 10, as veRL's GSPO.
    far = inputs([[12.0, 12.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[-1.0, -1.0]])
    for weights in ("mean", "own"):
        loss, grad, _ = loss_and_grad(far, loss="gspo", gspo_token_weights=weights)
        assert loss == pytest.approx(math.exp(10), rel=1e-5) and grad == [0.0, 0.0]
    # Below the bound the gradient is s A / |y| on each token.
    near = inputs([[9.0, 9.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[-1.0, -1.0]])
    assert loss_and_grad(near, loss="gspo")[1] == pytest.approx([math.exp(9) / 2] * 2, rel=1e-5)


@pytest.mark.parametrize("weights, expected", [("mean", [0.75, 0.75]), ("own", [1.0, 0.5])])
def test_gspo_with_token_weights_follows_the_chosen_convention(weights, expected):
    # On-policy (s = 1), A = 1, token mismatch weights rho = 2 and 1 (tis at 2): the value is the same,
    # -(2 + 1) / 2; the gradient on each token is -s A / |y| times the mean weight 1.5 (TRL) or its own (veRL).
    behaviour = [[-LN(2), 0.0]]
    inp = inputs([[0.0, 0.0]], [[0.0, 0.0]], behaviour, [[1.0, 1.0]])
    loss, grad, _ = loss_and_grad(inp, loss="gspo", gspo_token_weights=weights, mismatch={"mode": "tis"})
    assert loss == pytest.approx(-1.5) and grad == pytest.approx([-g for g in expected])


# --- eps_high ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_name", ["grpo", "drgrpo"])
def test_grpo_and_drgrpo_honour_eps_high_and_are_symmetric_without_it(loss_name):
    # Ratio 1.25, A = 1, one token: eps 0.2 on both sides clips it (loss -1.2, no gradient); eps_high 0.3 does not.
    def run(**cfg):
        return loss_and_grad(inputs([[LN(1.25)]], [[0.0]], [[0.0]], [[1.0]]), loss=loss_name, loss_scale_tokens=1,
                             **cfg)[:2]
    assert run() == (pytest.approx(-1.2), [0.0])
    assert run(eps_high=0.3) == (pytest.approx(-1.25), [pytest.approx(-1.25)])
    assert run(eps_low=0.1) == (pytest.approx(-1.1), [0.0])  # the symmetric default follows eps_low


def test_dapo_keeps_its_clip_higher_default():
    assert clip_range(TrainerConfig(loss="dapo")) == (0.2, 0.28)
    assert clip_range(TrainerConfig(loss="dapo", eps_high=0.4)) == (0.2, 0.4)


def test_eps_high_is_refused_where_the_loss_has_no_clip():
    with pytest.raises(ConfigError, match=r"trainer.eps_high=0.3: trainer.loss=dg clips no ratio"):
        load_config(None, ["trainer.loss=dg", "trainer.eps_high=0.3"])


# --- rollout-trainer mismatch -------------------------------------------------------------------------
# On-policy for the trainer (pi = pi_old, ratio 1), A = 1, rho = pi_old / pi_behav = 4, 1/2, 3/2.
RHO = [4.0, 0.5, 1.5]


def corrected(loss="dapo", mask=None, rho=RHO, **mismatch):
    behaviour = [[-LN(r) for r in rho]]
    zeros = [[0.0] * len(rho)]
    return loss_and_grad(inputs(zeros, zeros, behaviour, [[1.0] * len(rho)], mask), loss=loss, mismatch=mismatch)


@pytest.mark.parametrize("mismatch, weights, share", [
    ({"mode": "tis", "threshold": 2.0}, [2.0, 0.5, 1.5], 1 / 3),   # min(rho, 2)
    ({"mode": "mis", "threshold": 2.0}, [0.0, 0.5, 1.5], 1 / 3),   # rho, 0 above 2
    ({"mode": "mis", "threshold": 2.0, "threshold_low": 0.6}, [0.0, 0.0, 1.5], 2 / 3),
])
def test_token_level_mismatch_correction(mismatch, weights, share):
    loss, grad, stats = corrected(**mismatch)
    assert loss == pytest.approx(-sum(weights) / 3)
    assert grad == pytest.approx([-w / 3 for w in weights])  # the weight is detached: d(-w rho A) = -w
    assert stats["mismatch_corrected_fraction"] == pytest.approx(share)
    assert stats["mismatch_weight"] == pytest.approx(sum(weights) / 3)


def test_sequence_level_mismatch_correction():
    # Rows: tokens rho 4 and 1/2 (product 2), then one token rho 3/2 and padding.
    rho, mask = [[4.0, 0.5], [1.5, 9.0]], [[1.0, 1.0], [1.0, 0.0]]
    behaviour, zeros = [[-LN(r) for r in row] for row in rho], [[0.0, 0.0]] * 2
    inp = lambda: inputs(zeros, zeros, behaviour, [[1.0, 1.0], [1.0, 0.0]], mask)  # noqa: E731
    loss, grad, stats = loss_and_grad(inp(), loss="dapo", mismatch={"mode": "tis", "level": "sequence",
                                                                    "threshold": 1.8})
    assert loss == pytest.approx(-(1.8 + 1.8 + 1.5) / 3) and grad == pytest.approx([-0.6, -0.6, -0.5, 0.0])
    assert stats["mismatch_corrected_fraction"] == pytest.approx(2 / 3)
    loss, grad, stats = loss_and_grad(inp(), loss="dapo", mismatch={"mode": "mis", "level": "sequence",
                                                                    "threshold": 1.8})
    assert loss == pytest.approx(-1.5 / 3) and grad == pytest.approx([0.0, 0.0, -0.5, 0.0])


def test_mismatch_kl_is_k3_of_behaviour_against_the_trainer():
    _, _, stats = corrected()  # no correction: the KL is logged all the same
    assert stats["mismatch_kl"] == pytest.approx(sum(r - 1 - LN(r) for r in RHO) / 3, rel=1e-5)
    assert "mismatch_weight" not in stats


def test_decoupled_ppo_takes_the_mismatch_weight_once():
    # Its own weight is the same rho: trainer.mismatch bounds it in place of is_cap, never on top of it.
    tis = {"mode": "tis", "threshold": 2.0}
    assert corrected("decoupled_ppo", **tis)[:2] == corrected("dapo", **tis)[:2]
    loss, grad, _ = corrected("decoupled_ppo", rho=[10.0, 1.5])  # mode none: AReaL's cap 5 drops rho = 10
    assert loss == pytest.approx(-1.5 / 2) and grad == pytest.approx([0.0, -0.75])


def test_ppo_naive_refuses_a_mismatch_weight():
    with pytest.raises(ValueError, match="trainer.mismatch.mode=tis: trainer.loss=ppo_naive"):
        corrected("ppo_naive", mode="tis")


def test_mismatch_bounds_are_checked():
    with pytest.raises(ValueError, match="trainer.mismatch.threshold_low"):
        TrainerConfig(mismatch={"mode": "mis", "threshold": 2.0, "threshold_low": 3.0})
    with pytest.raises(ValueError, match="trainer.mismatch.threshold_low needs trainer.mismatch.mode=mis"):
        TrainerConfig(mismatch={"mode": "tis", "threshold_low": 0.5})


@pytest.mark.parametrize("mode", ["tis", "none"])
def test_a_step_with_a_large_mismatch_logs_a_warning(model_dir, ray_cluster, caplog, mode):  # noqa: F811
    """The step's KL is whole only once the ranks' shares are merged, in the driver's TrainerGroup."""
    groups = make_groups(0)
    for group in groups:  # behaviour log-probs far above the trainer's (about -log 64 for this model)
        for s in group.samples:
            s.completion.logprobs = [-0.5] * len(s.completion.token_ids)
    # Fresh samples (version 0) over two mini-batches: with a correction the trainer must recompute pi_old,
    # not reuse the engine's log-probs (then the weight would be 1); without one it reuses them, and the KL
    # must still be measured against the trainer's own forward, not read 0 by construction.
    cfg = trainer_config(backend="torch", mini_batches=2, mismatch={"mode": mode, "warn_kl": 0.5})
    trainer = TrainerGroup(Config(trainer=cfg), model_dir, SCORING)
    try:
        with caplog.at_level(logging.WARNING, logger="rlsys.trainer.worker"):
            metrics = train_step(trainer, groups, version=0)
        assert metrics["mismatch_kl"] > 0.5
        assert metrics.get("mismatch_corrected_fraction", 0.0) == 0.0  # rho < 1
        assert any("trainer.mismatch.warn_kl=0.5" in r.getMessage() for r in caplog.records)
    finally:
        trainer.shutdown()


# --- conventions ---------------------------------------------------------------------------------
def test_the_log_ratio_is_clamped_so_a_far_token_costs_no_step():
    # log ratio 100: exp overflows to inf and the step's gradient would be NaN; clamped at 20, it adds
    # a finite loss and no gradient.
    loss, grad, _ = loss_and_grad(inputs([[100.0]], [[0.0]], [[0.0]], [[-1.0]]), loss="dapo")
    assert loss == pytest.approx(math.exp(20), rel=1e-5) and grad == [0.0]


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_every_loss_bounds_a_far_ratio(loss_name, log_ratio, adv):
    # One token 100 nats from pi_old (sequence 0 of two tokens, so a sequence ratio is e^50, finite in float32),
    # beside an on-policy sequence: every loss clamps before exp, so its value and gradient stay within e^20 |A|
    # per token, whatever ratio it takes (token or sequence) and whichever way it is aggregated.
    old = [[-1.0 - log_ratio, -1.0], [-1.0, -1.0]]
    inp = inputs([[-1.0, -1.0], [-1.0, -1.0]], old, old, [[adv, adv], [adv, adv]], [[1.0, 1.0], [1.0, 0.0]])
    loss, grad, _ = loss_and_grad(inp, loss=loss_name, loss_scale_tokens=2)
    bound = math.exp(LOG_RATIO_BOUND) * (1 + 1e-5)
    assert math.isfinite(loss) and abs(loss) <= bound, loss
    assert all(math.isfinite(g) and abs(g) <= bound for g in grad), grad


def test_kl_k1_k2_keep_their_gradient_beyond_20_nats_and_k3_is_bounded():
    logprobs, ref = torch.tensor(0.0, requires_grad=True), torch.tensor(-30.0)
    for estimator, value, grad in [("k1", 30.0, 1.0), ("k2", 450.0, 30.0)]:
        kl = kl_penalty(logprobs, ref, estimator)
        assert kl.item() == pytest.approx(value) and torch.autograd.grad(kl, logprobs)[0].item() == pytest.approx(grad)
    far = kl_penalty(torch.tensor(-30.0), torch.tensor(0.0), "k3")  # log(pi_ref / pi) = 30: e^20 - 21 unclamped
    assert far.item() == 10.0


def test_overlong_cache_must_fit_in_max_len():
    with pytest.raises(ConfigError, match=r"reward.overlong.cache_len \(64\) must be at most reward.overlong.max_len"):
        load_config(None, ["reward.overlong.max_len=32", "reward.overlong.cache_len=64"])


def test_every_registered_loss_takes_every_aggregation_name():
    assert {"gspo", "drgrpo"} <= set(POLICY_LOSSES.names())
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                                 "token_sum_norm"}


# --- recipes ---------------------------------------------------------------------------------------
RECIPES = Path(CONFIG_DIR) / "recipes"


RECIPE_EXPECTED = [
    ("dapo", {"loss": "dapo", "advantage": "grpo", "eps_high": 0.28, "clip_ratio_c": 10.0}),
    ("drgrpo", {"loss": "drgrpo", "advantage": "drgrpo", "loss_scale_tokens": 96}),
    ("gspo", {"loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}),
    ("cispo", {"loss": "cispo", "eps_low": 1.0, "eps_high": 4.0}),
    ("gmpo", {"loss": "gmpo", "eps_low": 0.4, "eps_high": 0.4}),
    ("clip_cov", {"loss": "clip_cov", "cov_ratio": 2e-4, "clip_cov_bounds": (1.0, 5.0)}),
    ("kl_cov", {"loss": "kl_cov", "cov_ratio": 2e-3, "kl_cov_coef": 1.0}),
    ("sapo", {"loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}),
    ("reinforce_pp", {"loss": "grpo", "advantage": "reinforce_pp", "loss_aggregation": "token_mean"}),
    ("reinforce_pp_baseline", {"loss": "grpo", "advantage": "reinforce_pp_baseline"}),
    ("grpo_ref_sync", {"loss": "grpo", "advantage": "grpo"}),
    ("lora_grpo", {"loss": "grpo", "advantage": "grpo", "lr": 1e-3}),
    ("ppo_gae", {"loss": "grpo", "advantage": "gae", "loss_aggregation": "token_mean"}),
]
# Their KL term (the others have none): estimator, coef, in_reward, ref_sync_steps
RECIPE_KL = {"reinforce_pp": ("k1", 0.001, True, None), "reinforce_pp_baseline": ("k1", 0.001, True, None),
             "grpo_ref_sync": ("k3", 0.04, False, 8), "lora_grpo": ("k3", 0.001, False, None)}


def test_every_recipe_is_checked():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(name for name, _ in RECIPE_EXPECTED)


@pytest.mark.parametrize("name, expected", RECIPE_EXPECTED)
def test_recipes_load_and_validate(name, expected):
    cfg = load_config(RECIPES / f"{name}.yaml")
    assert {k: getattr(cfg.trainer, k) for k in expected} == expected
    kl = cfg.trainer.kl
    assert (kl.estimator, kl.coef, kl.in_reward, kl.ref_sync_steps) == RECIPE_KL[name] if name in RECIPE_KL else \
        kl.coef == 0.0
    if name == "dapo":
        assert cfg.control.dynamic_sampling.enabled and cfg.reward.overlong.enabled
        assert cfg.trainer.mismatch.mode == "tis"
