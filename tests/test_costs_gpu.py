"""The cost model against what a GPU measured: the built-in engine's decode grids on an H100."""
import importlib.util
import json
from pathlib import Path

import pytest

from rlsys.costs import BUILTIN_ENGINE, GPUS, EngineCost, ModelShape

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def grid(name: str) -> tuple[dict, ModelShape]:
    j = json.loads((RESULTS / name).read_text())
    m = j["settings"]["model"]
    return j, ModelShape.qwen2(m["hidden_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"],
                               m["intermediate_size"], j["settings"]["vocab"])


def live_keys(row: dict, settings: dict) -> float:
    """The keys of a grid point's batch, as engine_throughput.py counts them ("skewed": one at the longest length,
    the rest at the shortest), on average over its timed steps."""
    lengths = [int(n) for n in settings["lengths"].split(",")]
    b, context = row["batch"], row["context"]
    contexts = [max(lengths)] + [min(lengths)] * (b - 1) if context == "skewed" else [context] * b
    return sum(contexts) + b * settings["grid_steps"] / 2


def fit_script():
    spec = importlib.util.spec_from_file_location("builtin_engine_fit", ROOT / "benchmarks" / "builtin_engine_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_built_in_engine_profile_is_the_refit_of_every_point_of_its_graph_grid():
    """benchmarks/builtin_engine_fit.py over gpu_engine_graph_h100.json gives costs.BUILTIN_ENGINE's decode
    constants, and builtin_engine_fit_h100.json is its output: the fit, each point's error, their range and RMS."""
    j, shape = grid("gpu_engine_graph_h100.json")
    assert len(j["decode_step_grid"]) == 24 and j["settings"]["decode"] == "default"
    vllm = EngineCost.build(shape, GPUS["h100"], tp=1)
    for r in j["decode_step_grid"]:  # the vLLM figure it recorded is this cost model's
        assert abs(vllm.step_s(r["batch"], live_keys(r, j["settings"])) * 1e3 - r["cost_model_ms"]) < 1e-2
    script = fit_script()
    points = script.grid_points(j)
    assert sum(p["context"] == "skewed" for p in points) == 6 and len(points) == 24
    profile = script.fit(shape, "h100", points)
    assert profile == {k: BUILTIN_ENGINE[k] for k in ("overhead_s", "decode_mfu", "key_s")}
    stored = json.loads((RESULTS / "builtin_engine_fit_h100.json").read_text())
    assert stored["fit"] == profile
    errors = script.errors(BUILTIN_ENGINE, shape, "h100", points)
    assert [p["error"] for p in stored["points"]] == [round(e, 3) for e in errors]
    assert stored["errors"] == script.summary(errors)
    # the cost that sums the live KV, fitted the same way, follows the grid far worse
    paged = script.fit(shape, "h100", points, padded=False)
    assert stored["paged_form"]["fit"] == paged
    assert script.summary(script.errors(paged, shape, "h100", points, padded=False))["rms"] > 3 * stored["errors"]["rms"]


def test_a_padded_engines_step_grows_with_its_longest_sequence_and_vllms_with_the_sum():
    _, shape = grid("gpu_engine_graph_h100.json")
    padded = EngineCost.build(shape, GPUS["h100"], tp=1, **BUILTIN_ENGINE, max_len=4113)
    one_long = padded.step_s(64, 4096 + 63 * 128, 4096)  # the skewed batch
    assert one_long == padded.step_s(64, 64 * 4096, 4096)  # all long: the same step
    assert one_long > 2 * padded.step_s(64, 4096 + 63 * 128, 128)
    # keys in one bucket (shapes.py: multiples of 256 above 128, the last max_len) cost the same step
    assert padded.step_s(8, 0, 1025) == padded.step_s(8, 0, 1280) < padded.step_s(8, 0, 1281)
    assert padded.step_s(8, 0, 4097) == padded.step_s(8, 0, 4113)
    assert padded.step_s(8, 0, 129) - padded.fixed_s(8) == pytest.approx(256 * padded.growth_s(8), rel=1e-12)
    vllm = EngineCost.build(shape, GPUS["h100"], tp=1)
    assert vllm.step_s(64, 4096 + 63 * 128, 4096) == vllm.step_s(64, 4096 + 63 * 128, 128)  # the longest unread
    assert vllm.step_s(64, 64 * 4096) - vllm.step_s(64, 4096 + 63 * 128) == pytest.approx(
        63 * (4096 - 128) * vllm.kv_s_per_token, rel=1e-9)
    with pytest.raises(ValueError, match="max_len"):
        EngineCost.build(shape, GPUS["h100"], tp=1, **BUILTIN_ENGINE)


def test_the_eager_grid_stays_the_record_of_the_eager_engine_far_slower_than_vllm():
    """The eager step (gpu_engine_h100.json, before the graphs): 7-17 ms, at least 2.5x vLLM's modelled step."""
    j, shape = grid("gpu_engine_h100.json")
    vllm = EngineCost.build(shape, GPUS["h100"], tp=1)
    assert len(j["decode_step_grid"]) == 24
    for r in j["decode_step_grid"]:
        assert abs(vllm.step_s(r["batch"], live_keys(r, j["settings"])) * 1e3 - r["cost_model_ms"]) < 1e-2
        assert r["step_ms"] > 2.5 * r["cost_model_ms"]


def test_the_profiles_prefill_is_its_graph_grids_largest_prefills_within_4_percent():
    j, shape = grid("gpu_engine_graph_h100.json")
    cost = EngineCost.build(shape, GPUS["h100"], tp=1, **BUILTIN_ENGINE, max_len=4113)
    largest = sorted(j["prefill_grid"], key=lambda r: r["batch"] * r["length"])[-2:]
    assert [(r["batch"], r["length"]) for r in largest] == [(8, 1024), (32, 512)]
    for r in largest:
        assert abs(cost.prefill_s_per_token * r["batch"] * r["length"] * 1e3 / r["step_ms"] - 1) <= 0.04, r
