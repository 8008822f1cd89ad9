"""Trainer options for real workloads: precision and offload settings, the DeepSpeed config they make,
gradient checkpointing, and checkpoints that resume on another world size or ZeRO stage."""
import glob
import math

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import KL, SCORING, make_groups, max_diff, model_dir, run_steps, trainer_config  # noqa: F401

from rlsys.config import Config, ConfigError, TrainerConfig
from rlsys.startup import load_config
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.ds_config import deepspeed_config
from rlsys.trainer.universal import PerParameterState, save_per_parameter
from rlsys.trainer.worker import TrainerGroup

from helpers import float32_reorder_rel, train_step, trainer_weights


# --- config and the DeepSpeed dict (no DeepSpeed, no CUDA) ---------------------------------------
def test_zero3_bf16_with_offload_builds_every_section():
    cfg = TrainerConfig(zero_stage=3, dtype="bf16", offload_optimizer=True, offload_params=True, grad_clip=0.5)
    ds = deepspeed_config(cfg, world_size=64)
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.5 and ds["train_batch_size"] == 64
    assert ds["zero_optimization"] == {"stage": 3,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "offload_param": {"device": "cpu", "pin_memory": True}}


def test_defaults_are_fp32_without_offload():
    ds = deepspeed_config(TrainerConfig(), world_size=1)
    assert ds["bf16"] == {"enabled": False}
    assert ds["zero_optimization"] == {"stage": 2}


# DeepSpeedZeroConfig's fields in DeepSpeed 0.16.0, the floor of pyproject.toml's range (its source,
# deepspeed/runtime/zero/config.py; offload sections in offload_config.py). Its configs forbid unknown keys.
ZERO_KEYS_0_16 = {
    "allgather_bucket_size", "allgather_partitions", "contiguous_gradients", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "elastic_checkpoint", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "legacy_stage1", "load_from_fp32_weights", "max_live_parameters",
    "max_reuse_distance", "memory_efficient_linear", "mics_hierarchical_params_gather", "mics_shard_size",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
    "overlap_comm", "override_module_apply", "param_persistence_threshold", "pipeline_loading_checkpoint",
    "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter", "round_robin_gradients", "stage",
    "stage3_gather_fp16_weights_on_model_save", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights"}
OFFLOAD_KEYS_0_16 = {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                     "fast_init", "ratio", "buffer_size", "max_in_cpu"}


@pytest.mark.parametrize("stage, offload", [(0, False), (2, True), (3, True)])
def test_the_zero_section_is_accepted_by_every_deepspeed_in_the_declared_range(stage, offload):
    """The oldest DeepSpeed admitted knows every key; the installed one validates the section for real."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = TrainerConfig(zero_stage=stage, offload_optimizer=offload and stage > 0, offload_params=offload and stage == 3)
    zero = deepspeed_config(cfg, world_size=1)["zero_optimization"]
    assert set(zero) <= ZERO_KEYS_0_16, set(zero) - ZERO_KEYS_0_16
    for section in ("offload_optimizer", "offload_param"):
        assert set(zero.get(section, {})) <= OFFLOAD_KEYS_0_16
    assert DeepSpeedZeroConfig(**zero).stage == stage


@pytest.mark.parametrize("overrides, field", [
    (["trainer.offload_params=true"], "trainer.offload_params needs trainer.zero_stage=3"),
    (["trainer.offload_optimizer=true", "trainer.zero_stage=0"], "trainer.offload_optimizer needs"),
    (["trainer.backend=torch", "trainer.dtype=bf16"], "need trainer.backend=deepspeed"),
    (["trainer.dtype=fp16"], "trainer.dtype"),
])
def test_impossible_combinations_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides)


# --- gradient checkpointing ---------------------------------------------------------------------
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(model_dir, monkeypatch):  # noqa: F811
    from transformers.models.qwen2 import modeling_qwen2

    calls = [0]
    forward = modeling_qwen2.Qwen2MLP.forward

    def counted(self, x):
        calls[0] += 1
        return forward(self, x)

    monkeypatch.setattr(modeling_qwen2.Qwen2MLP, "forward", counted)
    samples = build_samples(make_groups(0), "grpo")
    _, totals = plan_step(samples, 1, 10**6)
    grads, counts = [], []
    for checkpointing in (False, True):
        backend = TorchBackend(trainer_config(micro_batch_tokens=10**6, gradient_checkpointing=checkpointing),
                               model_dir, SCORING)
        calls[0] = 0
        backend.accumulate_gradients(samples, totals)
        grads.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
        counts.append(calls[0])
        assert not backend.model.model.layers[0].mlp.training  # no dropout for all that
    assert counts == [2, 4]  # two layers, each run again in backward
    largest = max(g.abs().max().item() for g in grads[0].values())
    assert max_diff(*grads) < float32_reorder_rel(totals.tokens) * largest


# --- per-parameter optimizer state files ----------------------------------------------------------
def test_shards_saved_by_three_ranks_read_back_whole(tmp_path):
    names = [f"layer{i}.weight" for i in range(5)]
    full = {(n, k): torch.randn(3, 2) for n in names for k in ("exp_avg", "exp_avg_sq")}
    for rank in range(3):  # each rank keeps its round-robin share
        save_per_parameter(tmp_path, names, ["exp_avg", "exp_avg_sq"], lambda n, k: full[n, k], rank, 3, 7.0)
    assert len(load_file(str(tmp_path / "optimizer_shard1.safetensors"))) == 2 * 2  # layers 1 and 4
    with PerParameterState(tmp_path) as saved:
        assert saved.step == 7.0 and saved.shards == 3
        saved.check_names(names)
        assert all(torch.equal(saved.get(n, k), full[n, k]) for n, k in full)
        with pytest.raises(ValueError, match="another model"):
            saved.check_names(names[:-1] + ["other.weight"])
    (tmp_path / "optimizer_shard2.safetensors").unlink()
    with pytest.raises(ValueError, match="written by 3 ranks"):
        PerParameterState(tmp_path)


# --- resume on another world size (Ray actors, DeepSpeed on gloo) -----------------------------------
def make_trainer(model_dir, **overrides) -> TrainerGroup:  # noqa: F811
    return TrainerGroup(Config(trainer=trainer_config(kl=KL, backend="deepspeed", **overrides)), model_dir, SCORING)


def optimizer_tensors(folder) -> dict:
    found = {}
    for path in glob.glob(f"{folder}/optimizer_shard*.safetensors"):
        found.update(load_file(path))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("saved_as, resumed_as", [
    ({"zero_stage": 2}, {"zero_stage": 2}),
    ({"zero_stage": 3, "dtype": "bf16"}, {"zero_stage": 1, "dtype": "bf16"}),
], ids=["zero2-fp32", "zero3-to-zero1-bf16"])
def test_two_ranks_resume_on_one_and_back(ray_cluster, model_dir, tmp_path, saved_as, resumed_as):  # noqa: F811
    two = make_trainer(model_dir, world_size=2, **saved_as)
    one = None
    try:
        metrics, weights = run_steps(two, [0, 1], str(tmp_path / "two"))
        one = make_trainer(model_dir, world_size=1, **resumed_as)
        one.load(str(tmp_path / "two"))
        assert max_diff(trainer_weights(one), weights[0]) == 0.0
        one.save(str(tmp_path / "one"))  # what it holds now, written back: moments and masters, bit for bit
        saved = optimizer_tensors(tmp_path / "two")
        bf16 = saved_as.get("dtype") == "bf16"  # then the fp32 master weights are kept too
        assert len(saved) == (3 if bf16 else 2) * (len(weights[0]) - 1)  # lm_head is tied to the embeddings
        assert max_diff(optimizer_tensors(tmp_path / "one"), saved) == 0.0

        again, again_weights = run_steps(one, [1])
        assert again[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-3 if bf16 else 1e-4)
        if not bf16:  # in bf16, rounding a reordered sum may move a weight by one ulp
            assert max_diff(again_weights[0], weights[1]) < 1e-4

        two.load(str(tmp_path / "one"))  # and back onto two ranks
        assert max_diff(trainer_weights(two), weights[0]) == 0.0
        assert math.isfinite(train_step(two, make_groups(1))["loss"])
    finally:
        two.shutdown()
        if one is not None:
            one.shutdown()
