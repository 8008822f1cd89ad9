"""Issue 19's test of the Delightful Policy Gradient's claim: under contaminated sampling DG keeps learning
where importance-weighted policy gradients do not. Each loss under each friction (rlsys/friction.py) and all
of them at once, one run each on the default task, final accuracy with its eval standard error.

    python benchmarks/friction_sweep.py --steps 150 --output benchmarks/results/friction_sweep_cpu.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlsys.bench import machine, run_preset, summarise_run, write_report

LOSSES = ("dg", "dg_clipped", "decoupled_ppo", "ppo_naive")
ASYNC = ["control.scheduler=async"]
CONDITIONS = {  # every run uses the async scheduler, so that eta alone separates fresh from stale
    "none": ASYNC + ["control.staleness.eta=0"],
    "flipped_rewards": ASYNC + ["control.staleness.eta=0", "friction.reward_flip=0.2"],
    "wrong_temperature": ASYNC + ["control.staleness.eta=0", "friction.wrong_temperature_share=0.2",
                                  "friction.wrong_temperature=2.0"],
    "stale": ASYNC + ["control.staleness.eta=4"],
    "all": ASYNC + ["control.staleness.eta=4", "friction.reward_flip=0.2", "friction.wrong_temperature_share=0.2",
                    "friction.wrong_temperature=2.0"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--out-dir", default="runs/friction_sweep")
    p.add_argument("--output")
    args = p.parse_args(argv)
    start, results = machine(), {}
    report = {"command": f"python benchmarks/friction_sweep.py --steps {args.steps}",
              "workload": {"config": "configs/tiny.yaml", "steps": args.steps, "conditions": CONDITIONS},
              "machine": start, "results": results}
    for condition in args.conditions.split(","):  # condition outer: machine drift hits the losses alike
        for loss in args.losses.split(","):
            t = time.time()
            overrides = CONDITIONS[condition] + [f"trainer.loss={loss}", f"trainer.total_steps={args.steps}",
                                                 "control.save_every=0"]
            rows = run_preset(None, overrides, Path(args.out_dir) / f"{condition}-{loss}")
            summary = summarise_run(rows, target=1.0)
            results[f"{condition}/{loss}"] = {k: summary[k] for k in (
                "initial_accuracy", "final_accuracy", "final_accuracy_se", "eval_curve", "samples", "wall_s")}
            write_report(args.output, report)
            print(f"{condition} {loss}: {time.time() - t:.0f}s, final {summary['final_accuracy']:.3f} "
                  f"± {summary['final_accuracy_se']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
