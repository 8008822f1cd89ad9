"""The simulator against the published figures (CALIBRATION.md), then the best schedule at 128 GPUs.

    python benchmarks/sim_calibration.py --output benchmarks/results/sim_calibration.json

Each row: published, simulated, their ratio, and whether the config was fitted to it (`fitted`) or the row is
a prediction. Rows outside +-15% carry the reason: what the paper leaves unstated and what we assumed.
Then every scheduler x group sizer x staleness bound at 128 H800 with 32k responses (configs/sim/
scale_128gpu.yaml, fewer steps), each with the reward scheduler and streamed training, against veRL-style sync.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from rlsys.sim.run import simulate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"
TOLERANCE = 0.15
STACK = ["tail", "tail+reward", "tail+reward+planner", "tail+reward+planner+stream"]
ROLLPACKER = {  # config: (veRL / tail rollout s, cumulative stack speedups)
    "qwen7b_8k": ((82, 47), (1.30, 2.01, 2.01, 2.03)),
    "qwen14b_16k": ((277, 88), (1.48, 1.99, 2.02, 2.22)),
    "qwen32b_32k": ((673, 170), (2.21, 2.48, 2.52, 2.56)),
}
FITTED = {"rollout veRL", "rollout tail", "tail", "tail+reward"}  # see each config's header
REASONS = {
    "qwen32b_32k tail+reward+planner+stream": (
        "the paper does not say how much of training its stream trainer overlaps; we let streamed groups fill "
        "every GPU-second the rollout leaves idle, and the 32B trainer time fitted to the first two rows "
        "(~200 s a step) leaves much to fill"),
    "scaling": ("RollPacker states batch and GPUs per point, not its lengths or trainer time at 64/128 GPUs; "
                "we keep the 14B/16k config's fitted values, and the trainer, fitted at 32 GPUs, scales with GPUs"),
    "verl fully-async": (
        "veRL's page states 128 H20 and 28k responses, not the batch, the rollout/trainer split or the trainer "
        "cost; with 512 x 16 samples, half the GPUs training and the trainer at MFU 0.35, training bounds async"),
}


def load(name: str, **changes) -> dict:
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


def row(name: str, published: float, simulated: float, fitted: bool = False, reason: str | None = None,
        at_least: bool = False) -> dict:
    """`at_least`: the paper gives a lower bound ("more than"), met or not."""
    ratio = simulated / published
    within = ratio >= 1 if at_least else abs(ratio - 1) <= TOLERANCE
    out = {"name": name, "published": published, "simulated": round(simulated, 3), "ratio": round(ratio, 3),
           "fitted": fitted, "within": within}
    if not out["within"]:
        out["reason"] = reason or "no reason recorded"
    return out


def rollpacker_rows() -> list[dict]:
    rows = []
    for config, ((verl_s, tail_s), speedups) in ROLLPACKER.items():
        r = simulate(CONFIGS / f"{config}.yaml", quiet=True)["results"]
        rows.append(row(f"{config} rollout veRL s", verl_s, r["sync"]["rollout_time_s"], True))
        rows.append(row(f"{config} rollout tail s", tail_s, r["tail"]["rollout_time_s"], True))
        for label, published in zip(STACK, speedups):
            name = f"{config} {label}"
            rows.append(row(f"{name} speedup", published, r[label]["speedup_vs_sync"], label in FITTED,
                            REASONS.get(name)))
        if config == "qwen7b_8k":  # SortedRL's setting is unstated: RollPacker's smallest stands in
            cut = 1 - r["sorted"]["bubble_ratio"] / r["sync"]["bubble_ratio"]
            rows.append(row("sortedrl bubble ratio cut (>0.5)", 0.5, cut, at_least=True,
                            reason="SortedRL's lengths and batch are unpublished; RollPacker's 7B/8k stands in"))
    return rows


def scaling_rows() -> list[dict]:
    """14B/16k, batch 128 -> 512 on 32 -> 128 GPUs; throughput in trained prompts/s relative to veRL at 32."""
    points, base = [], None
    for gpus, prompts in ((32, 128), (64, 256), (128, 512)):
        cfg = load("qwen14b_16k", steps=10, schedulers=["sync", {**_stack_run(), "label": "rollpacker"}],
                   cluster={"gpus": gpus}, control={"prompts_per_step": prompts})
        r = simulate(cfg, quiet=True)["results"]
        rate = {k: v["trained_prompts"] / v["sim_time_s"] for k, v in r.items()}
        base = base or rate["sync"]
        points.append((gpus, rate["sync"] / base, rate["rollpacker"] / base))
    published = {32: (1.0, 2.22), 64: (1.42, 3.37), 128: (2.18, 4.81)}
    rows = []
    for gpus, verl, packer in points:
        rows.append(row(f"scaling 14b_16k {gpus} gpus veRL", published[gpus][0], verl, reason=REASONS["scaling"]))
        rows.append(row(f"scaling 14b_16k {gpus} gpus rollpacker", published[gpus][1], packer,
                        reason=REASONS["scaling"]))
    return rows


def _stack_run() -> dict:
    runs = load("qwen14b_16k")["schedulers"]
    stack = next(r for r in runs if isinstance(r, dict) and r.get("label") == STACK[-1])
    return {k: v for k, v in stack.items() if k != "label"}


def async_rows() -> list[dict]:
    r = simulate(CONFIGS / "verl_async_7b_28k.yaml", quiet=True)["results"]
    wait = r["async"]["step_time_s"] - r["async"]["train_time_s"]  # the trainer's wait for a batch
    return [row("verl fully-async speedup (2.35-2.67)", 2.51, r["async"]["speedup_vs_sync"],
                reason=REASONS["verl fully-async"]),
            row("verl rollout wait sync s", 178, r["sync"]["rollout_time_s"], reason=REASONS["verl fully-async"]),
            row("verl rollout wait async s", 33, max(wait, 0.0), reason=REASONS["verl fully-async"])]


SEARCH_STEPS = 10
SCHEDULES = {  # label: run fields, each with the reward scheduler and streamed training
    "sync": {"name": "sync"},
    "tail": {"name": "tail"},
    "sorted": {"name": "sorted"},
    **{f"sorted-partial-K{k}": {"name": "sorted", "control": {"sorted": {"mode": "partial", "max_versions": k}}}
       for k in (1, 2)},
    **{f"async-eta{eta}": {"name": "async", "cluster": {"trainer_gpus": 32}, "control": {"staleness": {"eta": eta}}}
       for eta in (1, 2, 4)},
}
SIZERS = {"G4": {"group_size": 4, "scale": 2.0}, "G8": {"group_size": 8, "scale": 1.0},
          "G16": {"group_size": 16, "scale": 0.5}, "sagc": {"group_sizer": "sagc"}}


def search_runs(prompts: int) -> list[dict]:
    runs = [{"name": "sync", "label": "veRL-sync"}]
    for label, run in SCHEDULES.items():
        for sizer, fields in SIZERS.items():
            control = {k: v for k, v in fields.items() if k != "scale"}
            if "scale" in fields:
                control["prompts_per_step"] = round(prompts * fields["scale"])
            elif run["name"] == "async":  # async counts its bound in fixed batches of prompts
                control["sagc"] = {"prompt_rule": "constant_prompts"}
            merged = {**run.get("control", {}), **control}
            runs.append({**run, "label": f"{label}/{sizer}", "control": merged,
                         "reward": {"overlap": True, "workers": None}, "trainer": {"streamed": True}})
    return runs


def search() -> dict:
    base = load("scale_128gpu")
    cfg = load("scale_128gpu", steps=SEARCH_STEPS, schedulers=search_runs(base["control"]["prompts_per_step"]))
    cfg["schedulers"][0]["name"] = "sync"
    results = simulate(cfg, quiet=True)["results"]
    reference = results["veRL-sync"]["step_time_s"]
    table = {label: {"speedup_vs_sync": round(reference / r["step_time_s"], 3),
                     "step_time_s": round(r["step_time_s"], 1), "bubble_ratio": round(r["bubble_ratio"], 3),
                     "straggler_rate": round(r["straggler_rate"], 3)}
             for label, r in results.items()}
    best = max((k for k in table if k != "veRL-sync"), key=lambda k: table[k]["speedup_vs_sync"])
    return {"best_128": {"schedule": best, "speedup_vs_sync": table[best]["speedup_vs_sync"]}, "search_128": table}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the rows and the search as JSON")
    parser.add_argument("--no-search", action="store_true", help="the calibration rows only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = rollpacker_rows() + scaling_rows() + async_rows()
    print(f"{'row':<52} {'published':>9} {'simulated':>9} {'ratio':>6}")
    for r in rows:
        mark = "fit" if r["fitted"] else ("" if r["within"] else "MISS")
        print(f"{r['name']:<52} {r['published']:>9.2f} {r['simulated']:>9.2f} {r['ratio']:>6.2f} {mark}")
    report = {"rows": rows}
    if not args.no_search:
        report.update(search())
        ranked = sorted(report["search_128"].items(), key=lambda kv: -kv[1]["speedup_vs_sync"])
        print(f"\n128 H800, 32k: {len(ranked)} schedules, {SEARCH_STEPS} steps each")
        for label, r in ranked:
            print(f"{label:<28} {r['speedup_vs_sync']:>5.2f}x  step {r['step_time_s']:>7.1f} s  "
                  f"bubble {r['bubble_ratio']:.2f}  straggler {r['straggler_rate']:.2f}")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"\n{report['wall_s']} s")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
