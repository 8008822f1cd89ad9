"""Issue 7's ablation: the `async` scheduler at staleness bounds eta with three losses, one run each,
on the default task. Writes wall time to a target accuracy and final accuracy per (loss, eta).

    python benchmarks/staleness_sweep.py --steps 100 --target 0.30 --output benchmarks/results/staleness_sweep_cpu.json
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rlsys.bench import machine, run_preset, summarise_run, write_report

LOSSES = ("decoupled_ppo", "dg", "ppo_naive")
ETAS = (0, 1, 2, 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--target", type=float, default=0.30)
    p.add_argument("--out-dir", default="runs/staleness_sweep")
    p.add_argument("--output", default="benchmarks/results/staleness_sweep_cpu.json")
    args = p.parse_args()
    results, start = {}, machine()
    report = {"command": f"python benchmarks/staleness_sweep.py --steps {args.steps} --target {args.target}",
              "workload": {"config": "configs/tiny.yaml", "steps": args.steps, "target_accuracy": args.target},
              "machine": start, "results": results}
    for eta in ETAS:  # eta outer, so machine drift hits the losses alike
        for loss in LOSSES:
            t = time.time()
            rows = run_preset(None, ["control.scheduler=async", f"control.staleness.eta={eta}", f"trainer.loss={loss}",
                                     f"trainer.total_steps={args.steps}", "control.eval_every=25",
                                     "control.save_every=0"], Path(args.out_dir) / f"{loss}-eta{eta}")
            summary = summarise_run(rows, args.target)
            summary["staleness_mean"] = next((r["staleness/mean"] for r in reversed(rows) if "staleness/mean" in r), None)
            results[f"{loss}/eta={eta}"] = summary
            report["machine"]["load_average_at_end"] = os.getloadavg()[0]
            write_report(args.output, report)
            print(f"{loss} eta={eta}: {time.time() - t:.0f}s, final {summary['final_accuracy']}, "
                  f"to target {summary['time_to_target_s']}", flush=True)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
