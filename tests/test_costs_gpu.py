"""The cost model against what a GPU measured: the built-in engine's decode grids on an H100."""
import itertools
import json
import math
from pathlib import Path

from rlsys.costs import BUILTIN_ENGINE, GPUS, EngineCost, ModelShape

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FIT_ERROR = (-0.52, 1.08)  # the profile's relative error over the graph grid, as rlsys/costs.py states it


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


def relative_errors(profile: dict, j: dict, shape: ModelShape) -> list[float]:
    cost = EngineCost.build(shape, GPUS["h100"], tp=1, **profile)
    return [cost.step_s(r["batch"], live_keys(r, j["settings"])) * 1e3 / r["step_ms"] - 1
            for r in j["decode_step_grid"]]


def test_the_built_in_engine_profile_is_the_minimax_fit_of_its_graph_grid_skewed_points_included():
    j, shape = grid("gpu_engine_graph_h100.json")
    assert len(j["decode_step_grid"]) == 24 and j["settings"]["decode"] == "default"
    vllm = EngineCost.build(shape, GPUS["h100"], tp=1)
    for r in j["decode_step_grid"]:  # the vLLM figure it recorded is this cost model's
        assert abs(vllm.step_s(r["batch"], live_keys(r, j["settings"])) * 1e3 - r["cost_model_ms"]) < 1e-2
    errors = relative_errors(BUILTIN_ENGINE, j, shape)
    assert FIT_ERROR[0] <= min(errors) < FIT_ERROR[0] + 0.01 and FIT_ERROR[1] - 0.01 < max(errors) <= FIT_ERROR[1]

    def worst(profile):
        return max(abs(math.log1p(e)) for e in relative_errors(profile, j, shape))
    for d_overhead, d_mfu in itertools.product((-5e-5, 0, 5e-5), (-1e-3, 0, 1e-3)):  # no neighbour fits better
        nudged = dict(BUILTIN_ENGINE, overhead_s=BUILTIN_ENGINE["overhead_s"] + d_overhead,
                      decode_mfu=BUILTIN_ENGINE["decode_mfu"] + d_mfu)
        assert worst(nudged) >= worst(BUILTIN_ENGINE) - 1e-12, (d_overhead, d_mfu)


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
    cost = EngineCost.build(shape, GPUS["h100"], tp=1, **BUILTIN_ENGINE)
    largest = sorted(j["prefill_grid"], key=lambda r: r["batch"] * r["length"])[-2:]
    assert [(r["batch"], r["length"]) for r in largest] == [(8, 1024), (32, 512)]
    for r in largest:
        assert abs(cost.prefill_s_per_token * r["batch"] * r["length"] * 1e3 / r["step_ms"] - 1) <= 0.04, r
