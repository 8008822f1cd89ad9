"""The per-GPU memory plan `rlsys check` prints (rlsys/memory.py): every shipped GPU config fits, its arithmetic
matches a hand computation, and a setting too big for its GPUs is refused with the numbers, before anything starts."""
import json
from pathlib import Path

import pytest

from rlsys.cli import main
from rlsys.config import ConfigError
from rlsys.memory import format_memory, plan_memory
from rlsys.startup import check_report, load_config

ROOT = Path(__file__).resolve().parent.parent
GPU_CONFIGS = sorted({*ROOT.glob("configs/*gpu*.yaml"), *ROOT.glob("configs/gpu/*.yaml"),
                      *ROOT.glob("examples/*/gpu*.yaml")})
SEVEN_B = str(ROOT / "configs/qwen2.5_7b_dapo_8gpu.yaml")
# Qwen2.5-7B's config.json, the fields the plan reads
QWEN7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
          "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}


def parts(side) -> dict[str, float]:
    return {name: b for name, b, _ in side.parts}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_gpu_config_has_a_plan_that_fits(path):
    cfg = load_config(path)
    plan = plan_memory(cfg)
    assert plan.sides and not plan.problems
    assert max(side.total for side in plan.sides) <= plan.memory
    assert "fits: peak" in check_report(cfg)


def test_seven_b_zero3_on_8_gpus_matches_the_hand_computation(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    plan = plan_memory(load_config(SEVEN_B, [f"model.path={tmp_path}"]))
    assert plan.source == str(tmp_path / "config.json")
    params = 28 * (3584 * 36 * 128 + 36 * 128 + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584) + 2 * 152064 * 3584 + 3584
    assert params == 7_615_616_512  # Qwen2.5-7B's published 7.61B
    generating, training = plan.sides
    got = parts(generating)
    assert got["trainer weights"] == got["trainer gradients"] == pytest.approx(params * 2 / 8)
    assert got["trainer optimizer"] == pytest.approx(params * 12 / 8)  # fp32 master, momentum, variance / 8
    assert got["vLLM engine"] == pytest.approx(0.65 * 80e9)
    assert generating.total == pytest.approx(0.65 * 80e9 + params * 16 / 8 + 1.6e9)  # + the trainer's CUDA context
    got = parts(training)
    per_layer = (8 * 3584 + 4 * 18944) * 2  # bytes a token a layer keeps without checkpointing
    assert got["activations"] == pytest.approx(16384 * (28 * 3584 * 2 + per_layer))
    assert got["output head"] == pytest.approx(1024 * 152064 * 16 + 152064 * 3584 * 4)
    assert got["ZeRO buffer"] == pytest.approx(1e9 * 2)  # stage3_max_live_parameters
    # the KV cache's tokens: what 0.65 x 80 GB leave after the weights and the workspace, at 57,344 bytes a token
    kv_tokens = (0.65 * 80e9 - params * 2 - 2e9) / (28 * 4 * 128 * 2 * 2)
    assert f"= {kv_tokens / 1e3:,.0f}k tokens" in format_memory(plan) and int(kv_tokens // 9216) >= 64


def test_separate_layout_plans_an_engine_gpu_and_a_trainer_gpu():
    plan = plan_memory(load_config(SEVEN_B, ["cluster.layout=separate", "rollout.num_workers=4",
                                             "trainer.world_size=4", "rollout.gpu_memory_utilization=0.9",
                                             "rollout.enable_sleep_mode=false", "weights.transfer=broadcast"]))
    engine, trainer = plan.sides
    assert list(parts(engine)) == ["vLLM engine"] and "vLLM engine" not in parts(trainer)
    assert parts(trainer)["trainer optimizer"] == pytest.approx(7.61e9 * 12 / 4)  # the table's 7B over 4 ranks


def test_seven_b_zero0_colocated_on_one_gpu_is_refused_with_the_numbers(tmp_path, capsys):
    run = tmp_path / "run"
    too_big = [SEVEN_B, "cluster.gpus_per_node=1", "rollout.num_workers=1", "trainer.world_size=1",
               "trainer.zero_stage=0", f"output_dir={run}"]
    assert main(["check", *too_big, "--other-machine"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # Adam's 12 bytes a parameter unsharded, and the field to change
    assert "needs 175.4 GB on each GPU (trainer optimizer 91.3" in err and "more than the 80 GB" in err
    assert "trainer.world_size=1" in err and "rollout.gpu_memory_utilization (now 0.65)" in err
    assert main(["train", *too_big]) == 2 and not run.exists()  # refused before anything started
    assert "memory plan: training (engine asleep) needs" in capsys.readouterr().err


def test_a_model_the_plan_cannot_size_is_named_not_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN7B, "num_experts": 64}))
    plan = plan_memory(load_config(SEVEN_B, [f"model.path={tmp_path}"]))
    assert not plan.sides and "mixture of experts" in format_memory(plan)
    unknown = plan_memory(load_config(SEVEN_B, ["model.path=models/SomeOther-8B"]))
    assert not unknown.sides and "none of qwen2.5-1.5b" in unknown.source


def test_the_gpu_page_shows_what_check_prints_and_the_measured_peak(monkeypatch, capsys):
    """docs/gpu.md pastes the 8-GPU config's plan as `rlsys check` prints it now, and its one GPU comparison is the
    results file's peak beside today's plan of that run's config."""
    monkeypatch.chdir(ROOT)
    page = (ROOT / "docs" / "gpu.md").read_text()
    assert main(["check", "configs/qwen2.5_7b_dapo_8gpu.yaml", "--other-machine"]) == 0
    assert capsys.readouterr().out in page
    run = json.loads((ROOT / "benchmarks/results/gpu_runs_h100.json").read_text())["runs"]["publish_cuda_ipc"]
    plan = plan_memory(load_config("configs/gpu/bench_0.5b.yaml", ["rollout.max_new_tokens=256",
                                                                   "model.warm_start.steps=0"]))
    measured = run["peak_gpu_memory_mib"]
    assert (f"peaked at {measured:,.0f} MiB ({measured * 2 ** 20 / 1e9:.1f} GB) on the H100; today's plan of that "
            f"config (`rollout.max_new_tokens=256 model.warm_start.steps=0`, as it ran) says "
            f"{max(s.total for s in plan.sides) / 1e9:.1f} GB") in " ".join(page.split())


def test_a_vllm_share_that_leaves_no_kv_cache_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization=0.2 of a h100 leaves the vLLM engine 0.0 GB "
                                          r"of KV cache after its 15.2 GB of weights .* vLLM would refuse to start"):
        load_config(SEVEN_B, ["rollout.gpu_memory_utilization=0.2"])
