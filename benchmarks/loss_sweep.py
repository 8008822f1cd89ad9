"""Issue 19's loss comparisons on the default task: each loss under staleness (the async scheduler at eta 0,
1, 2, 4) and under the friction testbed's contaminations (rlsys/friction.py), several runs per cell.

    python benchmarks/loss_sweep.py --steps 120 --repeats 3 --output benchmarks/results/loss_sweep_cpu.json

Repeat r runs with `seed=r`: the same warm-started model, a different draw of samples. An existing --output
is topped up, not redone: a cell runs only the seeds it lacks, so an interrupted sweep resumes where it
stopped and a larger --repeats adds runs to those measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rlsys.bench import machine, repeated_accuracy, run_preset, summarise_run, write_report

LOSSES = ("decoupled_ppo", "ppo_naive", "dg", "dg_clipped")
FLIP = ["friction.reward_flip=0.2"]
HOT = ["friction.wrong_temperature_share=0.2", "friction.wrong_temperature=2.0"]
# Every run uses the async scheduler, so that eta alone separates fresh samples from stale ones.
CONDITIONS = {
    "eta0": ["control.staleness.eta=0"],
    "eta1": ["control.staleness.eta=1"],
    "eta2": ["control.staleness.eta=2"],
    "eta4": ["control.staleness.eta=4"],
    "flipped_rewards": ["control.staleness.eta=0", *FLIP],
    "wrong_temperature": ["control.staleness.eta=0", *HOT],
    "all": ["control.staleness.eta=4", *FLIP, *HOT],
}
# condition -> the losses it compares: staleness alone leaves out the clipped DG, the frictions take all four
GRID = {condition: LOSSES if condition in ("eta0", "flipped_rewards", "wrong_temperature", "all") else LOSSES[:3]
        for condition in CONDITIONS}
RUN_KEYS = ("initial_accuracy", "final_accuracy", "final_accuracy_se", "samples", "wall_s", "staleness_mean")


def cell_summary(runs: list[dict]) -> dict:
    """A cell's mean final accuracy over its runs with its standard error (rlsys.bench.repeated_accuracy)."""
    finals = [r["final_accuracy"] for r in runs]
    staleness = [r["staleness_mean"] for r in runs if r.get("staleness_mean") is not None]
    mean, se = repeated_accuracy(runs)
    return {"runs": runs, "n": len(runs), "final_accuracy": mean, "final_accuracy_se": se,
            "final_accuracy_range": [min(finals), max(finals)],
            "staleness_mean": statistics.fmean(staleness) if staleness else None}


def run_cell(condition: str, loss: str, seed: int, steps: int, out_dir: Path) -> dict:
    overrides = ["control.scheduler=async", *CONDITIONS[condition], f"trainer.loss={loss}", f"seed={seed}",
                 f"trainer.total_steps={steps}", f"control.eval_every={steps}", "control.save_every=0"]
    rows = run_preset(None, overrides, out_dir / f"{condition}-{loss}-seed{seed}")
    summary = summarise_run(rows, target=1.0)
    summary["staleness_mean"] = next((r["staleness/mean"] for r in reversed(rows) if "staleness/mean" in r), None)
    return {"seed": seed, "eval_every": steps, **{k: summary[k] for k in RUN_KEYS}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--repeats", type=int, default=3, help="runs per cell, seeds 0 .. repeats-1")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--out-dir", default="runs/loss_sweep")
    p.add_argument("--output", required=True, help="the report JSON; an existing one is topped up")
    args = p.parse_args(argv)
    path = Path(args.output)
    report = json.loads(path.read_text()) if path.exists() else {
        "command": f"python benchmarks/loss_sweep.py --steps {args.steps} --repeats {args.repeats}",
        "workload": {"config": "configs/tiny.yaml", "steps": args.steps, "conditions": CONDITIONS},
        "machines": [], "results": {}}
    if report["workload"]["steps"] != args.steps:
        raise SystemExit(f"{path}: its runs are {report['workload']['steps']} steps, not --steps {args.steps}")
    report["machines"].append(machine())
    results = report["results"]
    for seed in range(args.repeats):  # seed outer: machine drift hits every cell alike
        for condition in args.conditions.split(","):
            for loss in GRID[condition]:
                key = f"{condition}/{loss}"
                runs = results.get(key, {}).get("runs", [])
                if any(r["seed"] == seed for r in runs):
                    continue
                t = time.time()
                runs = runs + [run_cell(condition, loss, seed, args.steps, Path(args.out_dir))]
                results[key] = cell_summary(runs)
                write_report(args.output, report)
                print(f"{key} seed {seed}: {time.time() - t:.0f}s, final {runs[-1]['final_accuracy']:.3f}; "
                      f"cell {results[key]['final_accuracy']:.3f} ± {results[key]['final_accuracy_se']:.3f} "
                      f"over {len(runs)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
