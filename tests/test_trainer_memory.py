"""Trainer memory on the GPU path, checked on CPU with DeepSpeed on gloo: the model and the KL reference are
built in the training dtype and, at ZeRO-3, partitioned as they are built; bf16 at ZeRO stage 0 saves and
resumes like the other stages."""
import os
import socket

import pytest
import ray
import torch
from safetensors.torch import load_file
from test_trainer import KL, SCORING, make_groups, max_diff, model_dir, run_steps, trainer_config  # noqa: F401

from rlsys.config import Config
from rlsys.trainer.worker import TrainerGroup

from helpers import trainer_weights


def rank_class():
    """One DeepSpeed rank in its own process, built as the trainer builds it, for inspection. Defined in a
    function so Ray ships it by value: the workers cannot import this test module."""

    def describe(module: torch.nn.Module) -> dict:
        """name -> (dtype, elements held here, elements in the whole parameter, ZeRO status, trainable)."""
        return {name: (str(p.dtype), p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel(),
                       getattr(p, "ds_numel", p.numel()), p.ds_status.name if hasattr(p, "ds_status") else None,
                       p.requires_grad)
                for name, p in module.named_parameters()}

    @ray.remote(num_cpus=1)
    class Rank:
        def build(self, cfg, model_dir, rank: int, world_size: int, port: int) -> None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK="0")
            torch.set_num_threads(1)
            from rlsys.trainer.deepspeed_backend import DeepSpeedBackend
            from rlsys.trainer.logprobs import Scoring

            self.backend = DeepSpeedBackend(cfg, model_dir, Scoring(), rank, world_size)

        def fresh_model(self) -> dict:
            """Parameters of a model just built by the backend's loader, before DeepSpeed wraps it."""
            return describe(self.backend._load_partitioned())

        def reference(self) -> tuple[str, dict]:
            reference = self.backend.reference
            return type(reference).__name__, describe(getattr(reference, "module", reference))

        def gathered_reference(self) -> dict:
            import deepspeed

            module = self.backend.reference.module
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {name: p.detach().float().clone() for name, p in module.named_parameters()}

    return Rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_ranks(model_dir, world_size: int, **overrides) -> list:  # noqa: F811
    cfg = trainer_config(kl=KL, backend="deepspeed", world_size=world_size, **overrides)
    ranks, port = [rank_class().remote() for _ in range(world_size)], free_port()
    ray.get([r.build.remote(cfg, model_dir, i, world_size, port) for i, r in enumerate(ranks)])
    return ranks


@pytest.mark.slow
def test_zero3_builds_model_and_reference_partitioned_in_bf16(ray_cluster, model_dir):  # noqa: F811
    ranks = build_ranks(model_dir, 2, zero_stage=3, dtype="bf16")
    try:
        for fresh in ray.get([r.fresh_model.remote() for r in ranks]):
            for name, (dtype, here, whole, status, _) in fresh.items():
                assert dtype == "torch.bfloat16" and status == "NOT_AVAILABLE", name
                assert here <= -(-whole // 2), name  # half of it (rounded up), never the whole
        for kind, reference in ray.get([r.reference.remote() for r in ranks]):
            assert kind == "DeepSpeedEngine"  # its own ZeRO-3 engine, without an optimizer
            for name, (dtype, here, whole, status, trainable) in reference.items():
                assert dtype == "torch.bfloat16" and status == "NOT_AVAILABLE" and not trainable, name
                assert here <= -(-whole // 2), name
        gathered = ray.get([r.gathered_reference.remote() for r in ranks])[0]  # a collective: on every rank
        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        assert max_diff(gathered, {n: w.to(torch.bfloat16).float() for n, w in weights.items() if n in gathered}) == 0
    finally:
        for r in ranks:
            ray.kill(r)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_below_zero3_the_reference_is_a_frozen_copy_in_the_training_dtype(ray_cluster, model_dir, stage):  # noqa: F811
    (rank,) = build_ranks(model_dir, 1, zero_stage=stage, dtype="bf16")
    try:
        kind, reference = ray.get(rank.reference.remote())
        assert kind == "Qwen2ForCausalLM"
        assert {(dtype, trainable) for dtype, _, _, _, trainable in reference.values()} == {("torch.bfloat16", False)}
    finally:
        ray.kill(rank)


@pytest.mark.slow
def test_zero0_bf16_saves_and_resumes_identically(ray_cluster, model_dir, tmp_path):  # noqa: F811
    config = Config(trainer=trainer_config(kl=KL, backend="deepspeed", zero_stage=0, dtype="bf16"))
    first = TrainerGroup(config, model_dir, SCORING)
    try:
        metrics, weights = run_steps(first, [0, 1, 2], str(tmp_path))
    finally:
        first.shutdown()
    saved = load_file(str(tmp_path / "optimizer_shard0.safetensors"))
    assert {key.rsplit("/", 1)[1] for key in saved} == {"exp_avg", "exp_avg_sq", "master"}
    resumed = TrainerGroup(config, model_dir, SCORING)
    try:
        resumed.load(str(tmp_path))
        assert max_diff(trainer_weights(resumed), weights[1]) == 0.0
        again, again_weights = run_steps(resumed, [2])
    finally:
        resumed.shutdown()
    assert again[0]["loss"] == metrics[2]["loss"] and again[0]["grad_norm"] == metrics[2]["grad_norm"]
    assert max_diff(again_weights[0], weights[2]) == 0.0
    assert max_diff(weights[2], weights[1]) > 0.0  # the step moved the weights
