"""LoRA RL (trainer.lora, peft): adapters train, the base stays frozen, engines get merged weights.

Real peft, transformers and DeepSpeed (gloo on CPU) on the tiny random Qwen2 of test_trainer.py.
"""
import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from rlsys.config import Config, TrainerConfig
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.trainer.backend import ADAPTER_EXPORT, TorchBackend, cpu_copy
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.worker import TrainerGroup
from rlsys.types import Group, Prompt, Request, SamplingParams, ScoredSample

from test_trainer import SCORING, TEMPERATURE, make_groups, max_diff, model_dir, run_steps  # noqa: F401 (a fixture)

LORA = {"rank": 4, "alpha": 8.0}
KL = {"estimator": "k3", "coef": 0.1}


def lora_config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-2, "micro_batch_tokens": 48, "loss": "dapo", "lora": LORA, "kl": KL,
                            "backend": "torch", **overrides})


def trained(backend, seeds=(0, 1)) -> TorchBackend:
    run_steps(backend, list(seeds))
    return backend


def test_lora_config_is_validated_naming_the_field():
    assert TrainerConfig().lora.rank == 0 and not TrainerConfig().lora.enabled
    with pytest.raises(ValidationError, match="dropout"):
        TrainerConfig(lora={"rank": 4, "dropout": 0.1})
    with pytest.raises(ValidationError, match="ref_sync_steps"):
        TrainerConfig(lora=LORA, kl={**KL, "ref_sync_steps": 2})
    with pytest.raises(ValidationError, match="zero_stage"):
        TrainerConfig(lora=LORA, zero_stage=3)


def test_unknown_target_modules_are_refused_naming_the_field(model_dir):
    with pytest.raises(ValueError, match="trainer.lora.target_modules: the model has no module named qkv"):
        TorchBackend(lora_config(lora={**LORA, "target_modules": ["q_proj", "qkv"]}), model_dir, SCORING)


def test_only_the_adapters_get_gradients_and_optimizer_state(model_dir):
    backend = TorchBackend(lora_config(), model_dir, SCORING)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    samples = build_samples(make_groups(0), "grpo")
    backend.accumulate_gradients(samples, plan_step(samples, 1, 48)[1])
    with_grad = {n for n, p in backend.model.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_A." in n or ".lora_B." in n for n in with_grad)
    assert with_grad == {n for n, p in backend.model.named_parameters() if p.requires_grad}
    backend._optimizer_step()
    stepped = {id(p) for p in backend.optimizer.state}
    assert stepped == {id(p) for n, p in backend.model.named_parameters() if n in with_grad}
    after = dict(backend.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= with_grad  # B starts at 0, so A moves only from the second step on


def test_merged_weights_are_base_plus_the_adapters(model_dir):
    backend = trained(TorchBackend(lora_config(), model_dir, SCORING))
    merged = backend.state_dict_for_rollout()
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert merged.keys() == base.keys()  # the base model's HF names, no peft prefix, no adapter tensors
    params = dict(backend.model.named_parameters())
    scale = LORA["alpha"] / LORA["rank"]
    adapted = 0
    for name, weight in merged.items():
        layer = name.removesuffix(".weight")
        a = params.get(f"base_model.model.{layer}.lora_A.default.weight")
        if a is None:
            assert torch.equal(weight, base[name]), name
            continue
        b = params[f"base_model.model.{layer}.lora_B.default.weight"]
        expected = base[name].double() + scale * (b.double() @ a.double())
        # float32: the B @ A product over rank 4 and the one addition round at most a few ulps of the weight
        bound = 8 * torch.finfo(torch.float32).eps * (expected.abs() + scale * (b.double().abs() @ a.double().abs()))
        assert ((weight.double() - expected).abs() <= bound).all(), name
        assert not torch.equal(weight, base[name]), name  # trained
        adapted += 1
    assert adapted == 2 * 7  # 2 layers x q, k, v, o, gate, up, down


def test_the_reference_is_the_base_model_with_the_adapters_off(model_dir):
    backend = trained(TorchBackend(lora_config(), model_dir, SCORING))
    plain = TorchBackend(lora_config(lora={"rank": 0}), model_dir, SCORING)  # the initial weights
    samples = build_samples(make_groups(5), "grpo")
    reference = backend.compute_logprobs(samples, model=backend.reference)
    for got, want in zip(reference, plain.compute_logprobs(samples)):
        assert got == pytest.approx(want, abs=1e-6)
    policy = backend.compute_logprobs(samples)
    assert max(abs(x - y) for p, r in zip(policy, reference) for x, y in zip(p, r)) > 1e-3
    assert sum(p.numel() for p in backend.reference.parameters()) == 0  # no second copy of the weights


def test_the_engine_generates_with_the_trained_adapters(model_dir):
    backend = trained(TorchBackend(lora_config(), model_dir, SCORING))
    published = cpu_copy(backend.published_weights())  # the adapted layers' merged weights alone
    assert len(published) == 2 * 7 and all(name.endswith("_proj.weight") for name in published)
    assert {name: t.shape for name, t in backend.published_shapes().items()} == \
        {name: t.shape for name, t in published.items()}
    engine = CPUEngine(model_dir, slots=4)  # starts from the base weights, as a run's engines do
    engine.load_weights(published, version=2)
    prompts = [[3, 9, 4], [7, 7, 12, 40, 2]]
    for i, prompt in enumerate(prompts):
        engine.add(Request(f"r{i}", f"p{i}", prompt, SamplingParams(max_new_tokens=10, temperature=TEMPERATURE,
                                                                    seed=i)))
    completions = {}
    while engine.has_work():
        completions.update((c.request_id, c) for c in engine.step())
    groups = [Group(Prompt(f"p{i}", "", ""), [ScoredSample(completions[f"r{i}"], 1.0)]) for i in range(2)]
    samples = build_samples(groups, "grpo")
    for sample, logprobs in zip(samples, backend.compute_logprobs(samples)):
        assert sample.logprobs == pytest.approx(logprobs, abs=1e-4)  # the engine's, as test_cpu_engine bounds them


def test_resume_from_a_checkpoint_continues_identically(model_dir, tmp_path):
    first = TorchBackend(lora_config(), model_dir, SCORING)
    run_steps(first, [0])
    first.save(str(tmp_path))
    assert (tmp_path / "adapter.safetensors").exists() and not (tmp_path / "model.safetensors").exists()
    metrics, uninterrupted = run_steps(first, [1, 2])
    resumed = TorchBackend(lora_config(seed=1), model_dir, SCORING)
    resumed.load(str(tmp_path))
    resumed_metrics, weights = run_steps(resumed, [1, 2])
    assert [max_diff(a, b) for a, b in zip(weights, uninterrupted)] == [0.0, 0.0]
    assert [m["loss"] for m in resumed_metrics] == [m["loss"] for m in metrics]


def test_export_loads_with_and_without_peft_to_the_same_logits(model_dir, tmp_path):
    backend = trained(TorchBackend(lora_config(), model_dir, SCORING))
    backend.export_hf(str(tmp_path))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / ADAPTER_EXPORT))
    assert not hasattr(merged, "peft_config")
    ids = torch.tensor([[3, 9, 4, 17, 22, 5, 60, 2]])
    with torch.no_grad():
        a, b = merged(ids).logits, adapted.eval()(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# --- DeepSpeed (Ray actors; marked slow) ----------------------------------------------------------
@pytest.mark.slow
def test_deepspeed_zero2_steps_the_adapters_alone_and_resumes_exactly(ray_cluster, model_dir, tmp_path):
    def group(**lora):
        cfg = lora_config(backend="deepspeed", zero_stage=2, world_size=2, **lora)
        return TrainerGroup(Config(trainer=cfg), model_dir, SCORING)

    def optimizer_bytes(trainer):
        import ray

        def count(worker):
            opt = worker.backend.engine.optimizer
            return sum(t.numel() * t.element_size() for s in opt.optimizer.state.values() for t in s.values()
                       if torch.is_tensor(t))
        return sum(ray.get([w.__ray_call__.remote(count) for w in trainer.workers]))

    full = group(lora={"rank": 0})
    try:
        run_steps(full, [0])
        full_bytes = optimizer_bytes(full)
    finally:
        full.shutdown()
    trainer = group()
    try:
        torch_run = run_steps(TorchBackend(lora_config(), model_dir, SCORING), [0, 1, 2])
        run = run_steps(trainer, [0, 1, 2], checkpoint=str(tmp_path / "ckpt"))
        # AdamW's two fp32 moments per adapter parameter, partitioned over the ranks (plus each rank's step count)
        local = TorchBackend(lora_config(), model_dir, SCORING).model
        adapters = sum(p.numel() for p in local.parameters() if p.requires_grad)
        assert 8 * adapters <= optimizer_bytes(trainer) <= 8 * adapters + 64
        assert full_bytes >= 8 * sum(p.numel() for p in local.get_base_model().parameters() if not p.requires_grad)
        for step, (x, y) in enumerate(zip(torch_run[1], run[1])):  # as test_trainer's assert_same_run
            assert max_diff(x, y) < 1e-4 * (step + 1)
        trainer.load(str(tmp_path / "ckpt"))
        resumed = run_steps(trainer, [2])
        assert max_diff(resumed[1][0], run[1][-1]) < 1e-4
        assert resumed[0][0]["loss"] == pytest.approx(run[0][-1]["loss"], rel=1e-4)
    finally:
        trainer.shutdown()


def test_all_linear_adapts_every_linear_layer_but_the_lm_head_as_peft(model_dir):  # noqa: F811
    from peft.tuners.lora import LoraLayer

    from rlsys.startup import load_config

    cfg = load_config(None, ["trainer.lora.rank=4", "trainer.lora.target_modules=all-linear"]).trainer
    assert cfg.lora.target_modules == "all-linear"  # veRL's default, a string as peft takes it
    backend = trained(TorchBackend(lora_config(lora={**LORA, "target_modules": "all-linear"}), model_dir, SCORING))
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    adapted = {n.removeprefix("base_model.model.") for n, m in backend.model.named_modules()
               if isinstance(m, LoraLayer)}
    assert "lm_head" in linear and adapted == linear - {"lm_head"}
    assert any(n.endswith("gate_proj") for n in adapted)  # the MLP's too
    moved = {n for n, t in backend.state_dict_for_rollout().items() if not torch.equal(t, base.state_dict()[n])}
    assert moved == {f"{n}.weight" for n in adapted}  # every adapted layer trained, the rest the base's
