"""The trainer on a tiny random Qwen2: torch and DeepSpeed backends, Ray actors, checkpoints, export.

DeepSpeed runs for real (gloo on CPU); the first run of a machine compiles a small comm extension.
"""
import json
import math
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from rlsys.config import Config, TrainerConfig
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step, split_mini_batches
from rlsys.trainer.logprobs import Scoring
from rlsys.trainer.losses import loglinear_proximal
from rlsys.trainer.worker import TrainerGroup
from rlsys.types import Completion, Group, Prompt, ScoredSample

from helpers import compute_logprobs, float32_reorder_rel, train_step, trainer_weights

VOCAB = 64
TEMPERATURE = 0.8
SCORING = Scoring(TEMPERATURE)  # how every trainer here scores tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 (tied embeddings, like rlsys's own tiny model) with a word-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", pad_token="w0", eos_token="w1").save_pretrained(path)
    return str(path)


def make_groups(seed: int, prompts: int = 4, group_size: int = 4) -> list[Group]:
    """Random prompts and responses of mixed lengths, 0/1 rewards with both values in most groups."""
    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        prompt_ids = [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 6))]
        samples = []
        for i in range(group_size):
            response = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 12))]
            completion = Completion(f"{seed}-{p}-{i}", f"p{p}", prompt_ids, response,
                                    [-math.log(VOCAB)] * len(response), [0] * len(response), "stop")
            samples.append(ScoredSample(completion, float(rng.random() < 0.5)))
        groups.append(Group(Prompt(f"p{p}", "", ""), samples))
    return groups


def trainer_config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-2, "micro_batch_tokens": 48, "loss": "dapo", **overrides})


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- in-process torch backend ------------------------------------------------------------------
@pytest.mark.parametrize("loss,kl", [("dapo", None), ("grpo", "k3")])
def test_micro_batching_gives_the_gradients_of_one_big_batch(model_dir, loss, kl):
    cfg = trainer_config(loss=loss, kl={"estimator": kl, "coef": 0.1 if kl else 0.0}, micro_batch_tokens=10**6)
    backend = TorchBackend(cfg, model_dir, SCORING)
    samples = build_samples(make_groups(0), cfg.advantage)
    _, totals = plan_step(samples, 1, cfg.micro_batch_tokens)
    whole = backend.accumulate_gradients(samples, totals)
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
    backend.optimizer.zero_grad()

    backend.cfg.micro_batch_tokens = 40
    _, totals = plan_step(samples, 1, 40)
    assert totals.micro_batches >= 4
    split = backend.accumulate_gradients(samples, totals)
    largest, rel = max(g.abs().max().item() for g in grads.values()), float32_reorder_rel(totals.tokens)
    assert largest > 1e-3  # the comparison is not vacuous
    assert max_diff(grads, {n: p.grad for n, p in backend.model.named_parameters()}) < rel * largest
    assert split["loss"] == pytest.approx(whole["loss"], rel=rel, abs=rel)  # a mean of terms of order 1
    assert split["entropy"] == pytest.approx(whole["entropy"], rel=rel)


def test_logprobs_match_a_plain_forward_at_the_temperature(model_dir):
    backend = TorchBackend(trainer_config(micro_batch_tokens=40), model_dir, SCORING)
    samples = build_samples(make_groups(1), "grpo")
    got = backend.compute_logprobs(samples)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for sample, logprobs in zip(samples, got):
        with torch.no_grad():  # one sequence alone, no padding: position t scores token t + 1
            logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0].double() / TEMPERATURE
        want = [(logits[t, sample.input_ids[t + 1]] - logits[t].exp().sum().log()).item()
                for t in range(sample.prompt_len - 1, len(sample.input_ids) - 1)]
        assert logprobs == pytest.approx(want, abs=1e-5)


def test_nan_loss_skips_the_step_and_leaves_weights_and_optimizer_untouched(model_dir):
    backend = TorchBackend(trainer_config(), model_dir, SCORING)
    run_steps(backend, [0])
    before = backend.state_dict_for_rollout()
    optimizer_step = [s["step"].item() for s in backend.optimizer.state.values()]
    poisoned = make_groups(1)
    poisoned[2].samples[0].reward = math.nan  # a reward function gone wrong: NaN advantages, NaN loss
    samples = build_samples(poisoned, "grpo")
    metrics = backend.train_step(samples, plan_step(samples, 1, 48)[1])
    assert math.isnan(metrics["loss"]) and metrics["skipped_steps"] == 1
    assert max_diff(before, backend.state_dict_for_rollout()) == 0.0
    assert [s["step"].item() for s in backend.optimizer.state.values()] == optimizer_step
    assert all(p.grad is None for p in backend.model.parameters())  # nothing leaks into the next step
    samples = build_samples(make_groups(2), "grpo")
    metrics = backend.train_step(samples, plan_step(samples, 1, 48)[1])
    assert math.isfinite(metrics["loss"]) and metrics["skipped_steps"] == 1
    assert max_diff(before, backend.state_dict_for_rollout()) > 0.0


def test_padding_micro_batch_adds_nothing(model_dir):
    backend = TorchBackend(trainer_config(), model_dir, SCORING)
    samples = build_samples(make_groups(0), "grpo")
    _, totals = plan_step(samples, 1, 48)
    padded = type(totals)(totals.tokens, totals.sequences, totals.micro_batches + 2)
    stats = backend.accumulate_gradients(samples, padded)
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
    backend.optimizer.zero_grad()
    assert backend.accumulate_gradients(samples, totals)["loss"] == pytest.approx(stats["loss"])
    assert max_diff(grads, {n: p.grad for n, p in backend.model.named_parameters()}) == 0.0


def test_resume_in_a_fresh_backend_continues_identically(model_dir, tmp_path):
    first = TorchBackend(trainer_config(), model_dir, SCORING)
    run_steps(first, [0])
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    first.save(str(tmp_path))
    metrics, uninterrupted = run_steps(first, [1])
    resumed = TorchBackend(trainer_config(seed=1), model_dir, SCORING)  # fresh optimizer, reseeded: all from files
    resumed.load(str(tmp_path))
    assert torch.equal(torch.get_rng_state(), rng)
    resumed_metrics, weights = run_steps(resumed, [1])
    assert max_diff(weights[0], uninterrupted[0]) == 0.0
    assert resumed_metrics[0]["loss"] == metrics[0]["loss"]


def test_a_checkpoint_of_another_layout_is_refused(model_dir, tmp_path):
    backend = TorchBackend(trainer_config(), model_dir, SCORING)
    backend.save(str(tmp_path))
    layout = json.loads((tmp_path / "trainer.json").read_text())
    (tmp_path / "trainer.json").write_text(json.dumps(dict(layout, world_size=2)))
    with pytest.raises(ValueError, match="same trainer.backend, trainer.world_size"):
        backend.load(str(tmp_path))


def test_torch_backend_refuses_several_ranks_before_starting_actors(model_dir):
    with pytest.raises(ValueError, match="trainer.world_size=2"):
        TrainerGroup(Config(trainer=trainer_config(backend="torch", world_size=2)), model_dir, SCORING)


# --- Ray actors, DeepSpeed (marked slow: each rank is a process that imports DeepSpeed) ------------
def run_steps(trainer, seeds, checkpoint=None):
    """One step per seed on a TrainerGroup or an in-process backend; save before the last if asked."""
    metrics, weights = [], []
    for i, seed in enumerate(seeds):
        if checkpoint and i == len(seeds) - 1:
            trainer.save(checkpoint)
        if isinstance(trainer, TrainerGroup):
            metrics.append(train_step(trainer, make_groups(seed)))
            weights.append(trainer_weights(trainer))
        else:
            samples = build_samples(make_groups(seed), trainer.cfg.advantage)
            metrics.append(trainer.train_step(samples, plan_step(samples, 1, trainer.cfg.micro_batch_tokens)[1]))
            weights.append(trainer.state_dict_for_rollout())
    return metrics, weights


KL = {"estimator": "k2", "coef": 0.05}  # on in every DeepSpeed run, so the reference model is exercised too


def make_trainer(model_dir, **overrides) -> TrainerGroup:
    return TrainerGroup(Config(trainer=trainer_config(kl=KL, **overrides)), model_dir, SCORING)


def assert_same_run(a, b, keys=("loss", "grad_norm", "kl", "entropy", "behaviour_logprob_diff")):
    """Same metrics and, step by step, the same weights up to float reassociation (lr 1e-2 makes a
    wrong update move weights by ~1e-2)."""
    (a_metrics, a_weights), (b_metrics, b_weights) = a, b
    for x, y in zip(a_metrics, b_metrics):
        assert x["tokens"] == y["tokens"] and x["sequences"] == y["sequences"]
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    for step, (x, y) in enumerate(zip(a_weights, b_weights)):
        assert max_diff(x, y) < 1e-4 * (step + 1)


@pytest.fixture(scope="module")
def one_rank_zero0(ray_cluster, model_dir):
    """The reference run: two steps of DeepSpeed without ZeRO on one rank. The trainer stays up."""
    trainer = make_trainer(model_dir, backend="deepspeed", zero_stage=0, world_size=1)
    try:
        yield trainer, run_steps(trainer, [0, 1])
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_torch_backend_and_deepspeed_zero0_agree(model_dir, one_rank_zero0):
    torch_run = run_steps(TorchBackend(trainer_config(kl=KL), model_dir, SCORING), [0, 1])
    assert_same_run(torch_run, one_rank_zero0[1])


@pytest.mark.slow
def test_zero0_skips_a_non_finite_step(one_rank_zero0):
    # Without ZeRO, DeepSpeed has no non-finite guard of its own: the backend's must hold.
    trainer, (_, weights) = one_rank_zero0
    poisoned = make_groups(2)
    poisoned[1].samples[0].reward = math.inf
    metrics = train_step(trainer, poisoned)
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert max_diff(trainer_weights(trainer), weights[1]) == 0.0


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def two_ranks(request, ray_cluster, model_dir, tmp_path_factory):
    """The reference steps on two ranks (two Ray actors, gloo), with a checkpoint before the second."""
    checkpoint = str(tmp_path_factory.mktemp(f"zero{request.param}") / "trainer")
    trainer = make_trainer(model_dir, backend="deepspeed", zero_stage=request.param, world_size=2)
    try:
        yield trainer, run_steps(trainer, [0, 1], checkpoint), checkpoint
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_two_ranks_match_one_rank(one_rank_zero0, two_ranks):
    _, run, _ = two_ranks
    assert run[0][0]["sequences"] == 16
    assert_same_run(one_rank_zero0[1], run)


@pytest.mark.slow
def test_reloading_a_checkpoint_continues_identically(two_ranks):
    # In the live trainer, whose weights, Adam moments and step counts have all moved on since.
    trainer, (metrics, weights), checkpoint = two_ranks
    trainer.load(checkpoint)
    assert max_diff(trainer_weights(trainer), weights[0]) == 0.0
    again_metrics, again_weights = run_steps(trainer, [1])
    assert max_diff(again_weights[0], weights[1]) == 0.0
    assert again_metrics[0]["loss"] == metrics[1]["loss"]
    assert again_metrics[0]["grad_norm"] == metrics[1]["grad_norm"]


@pytest.mark.slow
def test_a_nan_on_some_ranks_skips_the_step_on_all(two_ranks):
    trainer, _, _ = two_ranks
    before = trainer_weights(trainer)
    poisoned = make_groups(2)
    poisoned[0].samples[0].reward = math.nan  # the group's advantages are NaN, on whichever ranks hold it
    metrics = train_step(trainer, poisoned)
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["loss"])
    assert max_diff(trainer_weights(trainer), before) == 0.0
    assert train_step(trainer, make_groups(3))["skipped_steps"] == 1
    assert max_diff(trainer_weights(trainer), before) > 0.0


@pytest.mark.slow
def test_export_hf_gathers_the_weights_and_copies_the_tokenizer(model_dir, two_ranks, tmp_path):
    trainer, _, _ = two_ranks
    weights = trainer_weights(trainer)
    trainer.export_hf(str(tmp_path / "export"), model_dir)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert max_diff(exported.state_dict(), weights) == 0.0
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.model.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert tokenizer("w5 w7")["input_ids"] == AutoTokenizer.from_pretrained(model_dir)("w5 w7")["input_ids"]


@pytest.mark.slow
def test_compute_logprobs_across_ranks_keeps_the_input_order(model_dir, two_ranks):
    trainer, _, _ = two_ranks
    local = TorchBackend(trainer_config(), model_dir, SCORING)
    local.model.load_state_dict(trainer_weights(trainer))
    samples = build_samples(make_groups(4), "grpo")
    got = compute_logprobs(trainer, samples)
    for mine, theirs in zip(got, local.compute_logprobs(samples)):
        assert mine == pytest.approx(theirs, abs=1e-5)


# --- mini-batches: several optimizer steps on one rollout batch -----------------------------------
def test_later_mini_batches_are_scored_against_the_weights_at_the_start(model_dir):
    cfg = trainer_config(lr=3e-2)
    samples = build_samples(make_groups(4, prompts=6), cfg.advantage)
    first, second = split_mini_batches(samples, 2)
    parts = [(part, plan_step(part, 1, cfg.micro_batch_tokens)[1]) for part in (first, second)]

    recomputed = TorchBackend(cfg, model_dir, SCORING)
    recomputed.train_mini_batches(parts, fresh=False, proximal_micro_batches=0)

    by_hand = TorchBackend(cfg, model_dir, SCORING)  # proximal log-probs taken before any update, then two steps
    start = by_hand.compute_logprobs(samples)
    for sample, logprobs in zip(samples, start):
        sample.proximal_logprobs = logprobs
    for part, totals in parts:
        by_hand.train_step(part, totals)
    assert max_diff(recomputed.state_dict_for_rollout(), by_hand.state_dict_for_rollout()) < 1e-6

    naive = TorchBackend(cfg, model_dir, SCORING)  # the mistake: each mini-batch its own proximal policy
    for sample in samples:
        sample.proximal_logprobs = None
    for part, totals in parts:
        naive.train_step(part, totals)
    assert max_diff(naive.state_dict_for_rollout(), by_hand.state_dict_for_rollout()) > 1e-5


def test_fresh_samples_use_their_behaviour_logprobs_as_the_proximal_policy(model_dir):
    cfg = trainer_config(lr=3e-2)
    samples = build_samples(make_groups(5, prompts=6), cfg.advantage)
    true_logprobs = TorchBackend(cfg, model_dir, SCORING).compute_logprobs(samples)
    for sample, logprobs in zip(samples, true_logprobs):
        sample.logprobs = logprobs  # as the engine records them when these weights sampled the tokens
    parts = [(part, plan_step(part, 1, cfg.micro_batch_tokens)[1]) for part in split_mini_batches(samples, 3)]
    results = []
    for fresh in (True, False):
        backend = TorchBackend(cfg, model_dir, SCORING)
        metrics = backend.train_mini_batches(parts, fresh=fresh, proximal_micro_batches=0)
        results.append(backend.state_dict_for_rollout())
        assert metrics["sequences"] == len(samples)
    # Not fresh, the first part takes its own forward as pi_prox: the same values up to the float rounding of
    # another batch shape, which Adam's normalisation amplifies in near-zero-gradient weights.
    assert max_diff(*results) < 1e-4


def test_loglinear_proximal_interpolates_by_version_between_behaviour_and_current():
    behaviour, current = torch.tensor([[-2.0, -2.0, -2.0, -2.0]]), torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    versions = torch.tensor([[5, 4, 3, 1]])  # the step starts at version 5 and trains toward 6
    got = loglinear_proximal(behaviour, current, versions, 5)
    # alpha = (5 - v) / (6 - v): 0 for tokens the starting weights sampled, 1/2 one version older, 2/3, 4/5
    assert got[0].tolist() == pytest.approx([-2.0, -1.5, -2.0 + 2 / 3, -2.0 + 4 / 5])


def test_loglinear_runs_no_proximal_forward_and_is_exact_for_tokens_the_starting_weights_sampled(model_dir):
    """alpha is 0 for such tokens, so pi_prox is their behaviour log-prob: with behaviour log-probs that are the
    starting weights' own, the interpolated step equals the recomputed one. Staler tokens then move off it."""
    cfg = trainer_config(lr=3e-2)
    samples = build_samples(make_groups(5, prompts=6), cfg.advantage)
    for sample, logprobs in zip(samples, TorchBackend(cfg, model_dir, SCORING).compute_logprobs(samples)):
        sample.logprobs = logprobs  # what the engine recorded, sampling with the weights the step starts from
    parts = [(part, plan_step(part, 1, cfg.micro_batch_tokens)[1]) for part in split_mini_batches(samples, 3)]
    recomputed = TorchBackend(cfg, model_dir, SCORING)
    recomputed.train_mini_batches(parts, fresh=False, version=0)
    interpolated = TorchBackend(cfg.model_copy(update={"proximal": "loglinear"}), model_dir, SCORING)
    interpolated.compute_logprobs = None  # the point: no forward beside the training ones
    interpolated.train_mini_batches(parts, fresh=False, version=0)
    assert max_diff(recomputed.state_dict_for_rollout(), interpolated.state_dict_for_rollout()) < 1e-4

    stale = TorchBackend(cfg.model_copy(update={"proximal": "loglinear"}), model_dir, SCORING)
    stale.train_mini_batches(parts, fresh=False, version=1)  # every token one version old
    assert max_diff(stale.state_dict_for_rollout(), interpolated.state_dict_for_rollout()) > 1e-5


def test_loglinear_is_refused_with_a_mismatch_correction_naming_both_fields():
    with pytest.raises(ValueError, match="trainer.proximal=loglinear.*trainer.mismatch.mode=tis"):
        TrainerConfig(proximal="loglinear", mismatch={"mode": "tis"})


def test_mini_batches_are_contiguous_and_cover_every_sample():
    samples = build_samples(make_groups(6, prompts=5), "grpo")
    parts = split_mini_batches(samples, 3)
    assert [s for part in parts for s in part] == samples
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert split_mini_batches(samples[:2], 4) == [samples[:1], samples[1:2]]
