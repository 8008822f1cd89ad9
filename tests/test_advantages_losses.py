"""Advantages, losses and batching against hand-computed numbers (no model, no Ray)."""
import math

import pytest
import torch

from rlsys.config import TrainerConfig
from rlsys.trainer.advantages import ADVANTAGES, group_advantages
from rlsys.trainer.batching import (TrainSample, build_samples, collate, pack_micro_batches, plan_step,
                                    split_across_ranks)
from rlsys.trainer.logprobs import Scoring, token_logprobs
from rlsys.trainer.losses import LossInputs, compute_loss, kl_penalty
from rlsys.trainer.tensor_io import load_state, save_state
from rlsys.types import Completion, Group, Prompt, ScoredSample


# --- advantages ---------------------------------------------------------------------------------
def test_grpo_uses_sample_std():
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    assert adv == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)


def test_drgrpo_does_not_divide_by_std():
    assert group_advantages([3.0, 1.0, 2.0], "drgrpo") == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_others():
    assert group_advantages([1.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -0.5, -0.5])


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_degenerate_groups_get_zero_advantage(name):
    assert group_advantages([0.7], name) == [0.0]
    assert group_advantages([1.0, 1.0, 1.0], name) == [0.0, 0.0, 0.0]
    assert group_advantages([], name) == []


def test_unknown_estimator_names_the_choices():
    with pytest.raises(KeyError, match="drgrpo, gae, grpo, grpo_batch_std, reinforce_pp, reinforce_pp_baseline, rloo"):
        ADVANTAGES.get("ppo")


def _completion(rid, prompt, response):
    return Completion(rid, "p", prompt, response, [-0.5] * len(response), [0] * len(response), "stop")


def test_build_samples_uses_each_groups_realised_size():
    g2 = Group(Prompt("a", "", ""), [ScoredSample(_completion("a0", [1, 2], [3]), 1.0),
                                     ScoredSample(_completion("a1", [1, 2], [4, 5]), 0.0)])
    g3 = Group(Prompt("b", "", ""), [ScoredSample(_completion("b0", [6], [7]), 1.0),
                                     ScoredSample(_completion("b1", [6], []), 0.0),  # empty: counted, not trained
                                     ScoredSample(_completion("b2", [6], [8]), 0.0)])
    samples = build_samples([g2, g3], "rloo")
    assert [s.input_ids for s in samples] == [[1, 2, 3], [1, 2, 4, 5], [6, 7], [6, 8]]
    assert [s.prompt_len for s in samples] == [2, 2, 1, 1]
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, 1.0, -0.5])


def test_build_samples_refuses_missing_logprobs():
    bad = Completion("r7", "p", [1], [2, 3], [-0.1], [0, 0], "stop")
    with pytest.raises(ValueError, match="r7"):
        build_samples([Group(Prompt("p", "", ""), [ScoredSample(bad, 1.0)])], "grpo")


# --- losses -------------------------------------------------------------------------------------
def _inputs(logprobs, old, adv, mask, ref=None):
    logprobs = torch.tensor(logprobs, requires_grad=True)
    mask = torch.tensor(mask)
    return LossInputs(logprobs, torch.tensor(old), torch.zeros_like(mask), torch.tensor(adv), mask,
                      float(mask.sum()), float(mask.shape[0]), None if ref is None else torch.tensor(ref))


def test_sequence_mean_versus_token_mean_aggregation():
    # On-policy (ratio 1): per-token loss is -A. Sequence 0 has 1 token (A=1), sequence 1 has 3 (A=-1).
    mask = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    adv = [[1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]
    inp = _inputs([[0.0] * 3] * 2, [[0.0] * 3] * 2, adv, mask)
    grpo, _ = compute_loss(inp, TrainerConfig(loss="grpo"))
    dapo, _ = compute_loss(inp, TrainerConfig(loss="dapo"))
    assert grpo.item() == pytest.approx((-1.0 + 1.0) / 2)  # mean of sequence means
    assert dapo.item() == pytest.approx((-1.0 + 3.0) / 4)  # mean over the 4 tokens


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0: GRPO clips at 1.2, DAPO's eps_high 0.28 lets it through.
    log_ratio = math.log(1.25)
    inp = _inputs([[log_ratio]], [[0.0]], [[1.0]], [[1.0]])
    grpo, g_stats = compute_loss(inp, TrainerConfig(loss="grpo", eps_low=0.2))
    (grad_grpo,) = torch.autograd.grad(grpo, inp.logprobs)
    dapo, d_stats = compute_loss(inp, TrainerConfig(loss="dapo", eps_low=0.2, eps_high=0.28))
    (grad_dapo,) = torch.autograd.grad(dapo, inp.logprobs)
    assert grpo.item() == pytest.approx(-1.2) and g_stats["clip_fraction_high"] == 1.0
    assert grad_grpo.item() == 0.0  # clipped: no gradient
    assert dapo.item() == pytest.approx(-1.25) and d_stats["clip_fraction_high"] == 0.0
    assert grad_dapo.item() == pytest.approx(-1.25)  # d(-rho A)/d logp = -rho A


def test_lower_clip_applies_only_to_negative_advantages():
    log_ratio = math.log(0.75)
    neg = _inputs([[log_ratio]], [[0.0]], [[-1.0]], [[1.0]])
    loss, stats = compute_loss(neg, TrainerConfig(loss="dapo", eps_low=0.2))
    assert loss.item() == pytest.approx(0.8) and stats["clip_fraction_low"] == 1.0
    pos = _inputs([[log_ratio]], [[0.0]], [[1.0]], [[1.0]])
    loss, stats = compute_loss(pos, TrainerConfig(loss="dapo", eps_low=0.2))
    assert loss.item() == pytest.approx(-0.75) and stats["clip_fraction_low"] == 0.0


@pytest.mark.parametrize("estimator,expected", [
    ("k1", math.log(2)),                                 # log(pi / pi_ref), pi = 0.5, pi_ref = 0.25
    ("k2", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 - 1 + math.log(2)),                       # r - 1 - log r, r = pi_ref / pi = 0.5
])
def test_kl_estimators(estimator, expected):
    value = kl_penalty(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)), estimator)
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_kl_term_is_added_with_its_coefficient():
    inp = _inputs([[math.log(0.5)]], [[math.log(0.5)]], [[0.0]], [[1.0]], ref=[[math.log(0.25)]])
    cfg = TrainerConfig(loss="dapo", kl={"estimator": "k3", "coef": 0.1})
    loss, stats = compute_loss(inp, cfg)
    assert stats["kl"] == pytest.approx(0.5 - 1 + math.log(2))
    assert loss.item() == pytest.approx(0.1 * stats["kl"])


@pytest.mark.parametrize("loss_name", ["grpo", "dapo", "decoupled_ppo", "ppo_naive", "dg", "dg_clipped"])
def test_micro_batch_shares_sum_to_the_whole_batch_loss(loss_name):
    torch.manual_seed(0)  # float64: the parts' sum in another order agrees to ~1e-15 on any CPU
    mask = (torch.rand(6, 5, dtype=torch.float64) > 0.3).double()
    mask[:, 0] = 1.0
    logprobs, old = torch.randn(6, 5, dtype=torch.float64) - 2, torch.randn(6, 5, dtype=torch.float64) - 2
    adv = torch.randn(6, 1, dtype=torch.float64).expand(6, 5).contiguous()
    cfg = TrainerConfig(loss=loss_name, kl={"estimator": "k2", "coef": 0.05})
    ref = torch.randn(6, 5, dtype=torch.float64) - 2

    def share(rows):
        inp = LossInputs(logprobs[rows], old[rows], old[rows], adv[rows], mask[rows], float(mask.sum()), 6.0,
                         ref[rows])
        return compute_loss(inp, cfg)

    whole, whole_stats = share(slice(0, 6))
    parts = [share(slice(0, 2)), share(slice(2, 3)), share(slice(3, 6))]
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=1e-9)
    for key in whole_stats:
        assert sum(p[1][key] for p in parts) == pytest.approx(whole_stats[key], rel=1e-9, abs=1e-12), key


def test_token_logprobs_divide_logits_by_the_temperature():
    torch.manual_seed(0)
    logits, ids = torch.randn(1, 3, 5), torch.tensor([[1, 4, 2]])
    got, entropy = token_logprobs(logits, ids, Scoring(temperature=0.7), with_entropy=True)
    logp = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(got[0], logp[0, [0, 1], [4, 2]])
    assert torch.allclose(entropy[0], -(logp.exp() * logp).sum(-1)[0, :2])
    assert torch.allclose(token_logprobs(logits, ids, Scoring(temperature=0.0)), token_logprobs(logits, ids, Scoring(1.0)))


# --- batching -------------------------------------------------------------------------------------
def _sample(n_prompt, n_response, adv=0.0):
    return TrainSample(list(range(1, n_prompt + n_response + 1)), n_prompt, adv, [-1.0] * n_response,
                       [0] * n_response)


def test_micro_batches_respect_the_budget_counting_padding():
    samples = [_sample(2, n) for n in (1, 9, 3, 4, 2, 6)]  # lengths 3, 11, 5, 6, 4, 8
    batches = pack_micro_batches(samples, token_budget=16)
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(s.num_tokens for s in batch) <= 16
    alone = pack_micro_batches([_sample(10, 10), _sample(1, 1)], token_budget=8)
    assert [len(b) for b in alone] == [1, 1]  # longer than the budget: a micro-batch of its own


def test_ranks_get_balanced_tokens_and_the_same_micro_batch_count():
    samples = [_sample(2, n) for n in (30, 1, 2, 3, 10, 12, 5, 9)]
    ranks = split_across_ranks(samples, 2)
    loads = [sum(s.num_tokens for s in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 2 and sum(len(r) for r in ranks) == len(samples)
    _, totals = plan_step(samples, 2, token_budget=32)
    assert totals.tokens == sum(s.trained_tokens for s in samples) and totals.sequences == 8
    assert totals.micro_batches == max(len(pack_micro_batches(r, 32)) for r in ranks)


def test_collate_masks_only_response_tokens():
    mb = collate([_sample(2, 2, adv=0.5), _sample(1, 1, adv=-1.0)])
    assert mb.input_ids.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert mb.response_mask.tolist() == [[0, 1, 1], [1, 0, 0]]  # position t predicts token t + 1
    assert mb.advantages.tolist() == [[0, 0.5, 0.5], [-1, 0, 0]]
    assert collate([]).response_mask.sum() == 0  # the padding micro-batch


def test_tensor_io_round_trips_an_optimizer_like_state(tmp_path):
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}},
             "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 1e-3, "fused": None}],
             "numpy": __import__("numpy").arange(3, dtype="uint32")}
    save_state(state, tmp_path, "opt")
    back = load_state(tmp_path, "opt")
    assert set(back["state"]) == {0} and back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["numpy"].tolist() == [0, 1, 2] and back["param_groups"][0]["fused"] is None


# --- staleness-robust losses ----------------------------------------------------------------------
def _stale(logprobs, old, behaviour, adv):
    logprobs = torch.tensor(logprobs, requires_grad=True)
    mask = torch.ones_like(logprobs)
    return LossInputs(logprobs, torch.tensor(old), torch.tensor(behaviour), torch.tensor(adv), mask,
                      float(mask.sum()), float(mask.shape[0]))


def _loss_and_grad(inp, **cfg):
    loss, stats = compute_loss(inp, TrainerConfig(**cfg))
    (grad,) = torch.autograd.grad(loss, inp.logprobs)
    return loss.item(), grad, stats


def test_decoupled_ppo_is_dapo_when_behaviour_is_proximal():
    torch.manual_seed(0)
    logprobs, old = (torch.randn(4, 6) - 2).tolist(), (torch.randn(4, 6) - 2).tolist()
    adv = torch.randn(4, 1).expand(4, 6).tolist()
    dapo = _loss_and_grad(_stale(logprobs, old, old, adv), loss="dapo")
    dppo = _loss_and_grad(_stale(logprobs, old, old, adv), loss="decoupled_ppo")
    assert dppo[0] == dapo[0] and torch.equal(dppo[1], dapo[1])
    assert dppo[2]["mismatch_corrected_fraction"] == 0.0 and dppo[2]["mismatch_weight"] == pytest.approx(1.0)


def test_decoupled_ppo_weights_by_proximal_over_behaviour_and_drops_capped_tokens():
    # Token 0: w = 2, ratio 1, A = 1 -> loss -2, gradient -2, over 3 tokens. Token 1: w = 10 > cap 5, dropped.
    # Token 2: w = e^1000 overflows to inf; still dropped, and no NaN reaches the gradient.
    inp = _stale([[0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]], [[-math.log(2), -math.log(10), -1000.0]], [[1.0] * 3])
    loss, grad, stats = _loss_and_grad(inp, loss="decoupled_ppo", is_cap=5.0)
    assert loss == pytest.approx(-2 / 3)  # the dropped tokens still count in the step's 3 tokens
    assert grad.flatten().tolist() == pytest.approx([-2 / 3, 0.0, 0.0])
    assert stats["mismatch_corrected_fraction"] == pytest.approx(2 / 3)
    assert stats["mismatch_weight"] == pytest.approx(2 / 3)


def test_ppo_naive_takes_the_behaviour_policy_as_old():
    # pi / pi_behav = 1.5 > 1 + 0.28 with A > 0: clipped (no gradient), whatever the proximal policy says.
    inp = _stale([[math.log(1.5)]], [[math.log(1.5)]], [[0.0]], [[1.0]])
    loss, grad, stats = _loss_and_grad(inp, loss="ppo_naive")
    assert loss == pytest.approx(-1.28) and grad.item() == 0.0 and stats["clip_fraction_high"] == 1.0
    as_dapo = _loss_and_grad(_stale([[math.log(1.5)]], [[0.0]], [[0.0]], [[1.0]]), loss="dapo")
    assert loss == as_dapo[0]
    assert _loss_and_grad(inp, loss="dapo")[1].item() == pytest.approx(-1.0)  # dapo: ratio to proximal is 1


@pytest.mark.parametrize("adv, logprob, gate", [
    (1.0, math.log(1e-4), 1 / (1 + 1e-4)),   # rare success: passes
    (-1.0, math.log(1e-4), 1e-4 / (1 + 1e-4)),  # rare failure: suppressed
    (1.0, 0.0, 0.5), (-1.0, 0.0, 0.5),        # a certain token: delight 0, half weight
])
def test_delight_gate_at_chosen_points(adv, logprob, gate):
    inp = _stale([[logprob]], [[logprob]], [[0.0]], [[adv]])
    _, grad, stats = _loss_and_grad(inp, loss="dg")
    assert stats["dg_gate"] == pytest.approx(gate, rel=1e-4)
    assert grad.item() == pytest.approx(-gate * adv, rel=1e-4)  # d(-w A log pi)/d log pi, w detached


def test_dg_gradient_by_hand():
    # eta 1, l = log 3 for both tokens: A = 1 -> gate sigmoid(log 3) = 3/4; A = -2 -> sigmoid(-2 log 3) = 1/10.
    inp = _stale([[-math.log(3)], [-math.log(3)]], [[0.0], [0.0]], [[0.0], [0.0]], [[1.0], [-2.0]])
    loss, grad, stats = _loss_and_grad(inp, loss="dg", dg_eta=1.0)
    assert loss == pytest.approx((0.75 * math.log(3) - 0.2 * math.log(3)) / 2)
    assert grad.flatten().tolist() == pytest.approx([-0.75 / 2, 0.2 / 2])
    assert stats["dg_gate"] == pytest.approx((0.75 + 0.1) / 2) and stats["dg_gate_low"] == 0.0
    # eta scales the delight: eta 2 gives sigmoid(log 3 / 2) = sqrt(3) / (1 + sqrt(3)) for A = 1.
    _, grad, _ = _loss_and_grad(_stale([[-math.log(3)]], [[0.0]], [[0.0]], [[1.0]]), loss="dg", dg_eta=2.0)
    assert grad.item() == pytest.approx(-math.sqrt(3) / (1 + math.sqrt(3)))


def test_dg_clipped_is_dg_at_ratio_one_and_clips_beyond():
    torch.manual_seed(1)
    logprobs, adv = (torch.randn(3, 4) - 1).tolist(), torch.randn(3, 1).expand(3, 4).tolist()
    dg = _loss_and_grad(_stale(logprobs, logprobs, logprobs, adv), loss="dg")
    clipped = _loss_and_grad(_stale(logprobs, logprobs, logprobs, adv), loss="dg_clipped")
    assert torch.allclose(clipped[1], dg[1])
    far = _stale([[math.log(0.5)]], [[math.log(0.25)]], [[0.0]], [[1.0]])  # ratio 2, A > 0: clipped
    loss, grad, stats = _loss_and_grad(far, loss="dg_clipped")
    gate = 1 / (1 + 0.5)  # sigmoid(log 2) = 2/3
    assert loss == pytest.approx(-gate * 1.28) and grad.item() == 0.0 and stats["clip_fraction_high"] == 1.0
