"""The built-in engine's cost profile (rlsys/costs.py BUILTIN_ENGINE) fitted to its decode grid on a GPU.

    python benchmarks/builtin_engine_fit.py --out benchmarks/results/builtin_engine_fit_h100.json

Every point of the grid (benchmarks/results/gpu_engine_graph_h100.json, engine_throughput.py's decode grid),
skewed ones included, is charged as rlsys.costs.EngineCost charges a padded engine: the step's rows over the key
bucket of the longest sequence. For each decode MFU (in steps of 0.001) the fixed cost a step and the cost a key
are the least squares of the relative error (linear in both); the MFU of the least such error wins. Stored
rounded to 3 significant figures. The same least squares over the cost that sums the live KV (paged, as vLLM's)
is written beside it: the form the padded cost replaces.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlsys.costs import BUILTIN_ENGINE, GPUS, EngineCost, ModelShape  # noqa: E402

GRID = ROOT / "benchmarks" / "results" / "gpu_engine_graph_h100.json"
MFUS = np.round(np.arange(0.010, 0.600, 0.001), 3)


def grid_points(grid: dict) -> list[dict]:
    """Each decode point's batch, live keys and longest sequence's keys on average over its timed steps (as
    engine_throughput.py runs them: prompts of the context's length, `grid_steps` new tokens each; "skewed": one
    at the longest length, the rest at the shortest), and the engine's max_len there."""
    s = grid["settings"]
    lengths = [int(n) for n in s["lengths"].split(",")]
    steps = s["grid_steps"]
    points = []
    for r in grid["decode_step_grid"]:
        b, shape = r["batch"], r["context"]
        contexts = [max(lengths)] + [min(lengths)] * (b - 1) if shape == "skewed" else [shape] * b
        points.append({"batch": b, "context": shape, "step_ms": r["step_ms"], "live_keys": sum(contexts) + b * steps / 2,
                       "longest_keys": max(contexts) + steps / 2, "max_len": max(lengths) + steps + 1})
    return points


def model_shape(grid: dict) -> ModelShape:
    m = grid["settings"]["model"]
    return ModelShape.qwen2(m["hidden_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"],
                            m["intermediate_size"], grid["settings"]["vocab"])


def modelled_ms(profile: dict, shape: ModelShape, gpu: str, points: list[dict], padded: bool) -> np.ndarray:
    """Each point's step under `profile`, padded (the longest's key bucket) or paged (the live KV summed)."""
    out = []
    for p in points:
        if padded:
            cost = EngineCost.build(shape, GPUS[gpu], tp=1, **profile, max_len=p["max_len"])
        else:
            cost = EngineCost.build(shape, GPUS[gpu], tp=1, **{k: v for k, v in profile.items() if k != "key_s"})
        out.append(cost.step_s(p["batch"], p["live_keys"], p["longest_keys"]) * 1e3)
    return np.array(out)


def fit(shape: ModelShape, gpu: str, points: list[dict], padded: bool = True) -> dict:
    """overhead_s (and key_s, padded) by least squares of the relative error at each decode MFU; the best MFU."""
    measured = np.array([p["step_ms"] for p in points])
    best = None
    for mfu in MFUS:
        bare = {"overhead_s": 0.0, "decode_mfu": float(mfu)}
        rest = modelled_ms(bare | ({"key_s": 0.0} if padded else {}), shape, gpu, points, padded)
        columns = [np.ones_like(measured)]
        if padded:  # the step's KV term grows by key_s for each key of its bucket
            keys = modelled_ms(bare | {"key_s": 1e-3}, shape, gpu, points, True) - rest  # ms per (1 ms a key)
            columns.append(keys)
        a = np.stack(columns, 1) / measured[:, None]
        x, *_ = np.linalg.lstsq(a, 1 - rest / measured, rcond=None)
        error = float(np.sum((rest / measured + a @ x - 1) ** 2))
        if best is None or error < best[0]:
            best = (error, float(mfu), x)
    _, mfu, x = best
    profile = {"overhead_s": sig3(x[0] * 1e-3), "decode_mfu": mfu}
    if padded:
        profile["key_s"] = sig3(x[1] * 1e-3)
    return profile


def sig3(x: float) -> float:
    return float(f"{x:.3g}")


def errors(profile: dict, shape: ModelShape, gpu: str, points: list[dict], padded: bool = True) -> list[float]:
    measured = np.array([p["step_ms"] for p in points])
    return (modelled_ms(profile, shape, gpu, points, padded) / measured - 1).tolist()


def summary(errs: list[float]) -> dict:
    return {"min": round(min(errs), 3), "max": round(max(errs), 3),
            "rms": round(math.sqrt(sum(e * e for e in errs) / len(errs)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", type=Path, default=GRID)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    grid = json.loads(args.grid.read_text())
    shape, points = model_shape(grid), grid_points(grid)
    padded = fit(shape, args.gpu, points)
    paged = fit(shape, args.gpu, points, padded=False)
    profile = padded | {"prefill_mfu": BUILTIN_ENGINE["prefill_mfu"]}
    errs = errors(profile, shape, args.gpu, points)
    for p, e in zip(points, errs):
        p["model_ms"] = round(p["step_ms"] * (1 + e), 3)
        p["error"] = round(e, 3)
    report = {"command": "python benchmarks/builtin_engine_fit.py" + (f" --out {args.out}" if args.out else ""),
              "grid": str(args.grid.resolve().relative_to(ROOT)) if args.grid.resolve().is_relative_to(ROOT)
              else args.grid.name, "gpu": args.gpu,
              "what": "the built-in engine's decode step (CUDA graphs, padded to the longest sequence's key bucket) "
                      "against rlsys.costs' padded cost, least squares of the relative error, every grid point",
              "fit": padded, "errors": summary(errs), "points": points,
              "paged_form": {"fit": paged, "errors": summary(errors(paged, shape, args.gpu, points, padded=False))}}
    text = json.dumps(report, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text if not args.out else json.dumps({"fit": padded, "errors": report["errors"],
                                                "paged_form": report["paged_form"]}))


if __name__ == "__main__":
    main()
