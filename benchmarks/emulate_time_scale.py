"""The time scale at which this machine keeps up with an emulated GPU: short emulated runs of a config at several
`emulate.time_scale`s, for a schedule that leaves the engines idle while training (sync) and one that runs the
engines and the trainer at once (async); each run's overrun share (docs/design.md "Emulated clock"). The report
is rewritten after every run.

    python benchmarks/emulate_time_scale.py --scales 0.1,0.05 --steps 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlsys.bench import PRESETS, machine, run_preset, write_report  # noqa: E402

CONFIG = "configs/emulated_h100_7b.yaml"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--scales", default="0.1,0.05")
    p.add_argument("--presets", default="sync,async")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", default="runs/emulate_time_scale")
    p.add_argument("--output", default="benchmarks/results/emulate_time_scale_cpu.json")
    args = p.parse_args(argv)
    common = [f"trainer.total_steps={args.steps}", "control.eval_every=0", "control.save_every=0", "data.eval_size=32"]
    report = {"command": "python benchmarks/emulate_time_scale.py " + " ".join(argv or sys.argv[1:]),
              "config": args.config, "overrides": common, "machine": machine(), "runs": []}
    for scale in args.scales.split(","):
        for name in args.presets.split(","):
            t = time.time()
            rows = run_preset(args.config, common + PRESETS[name] + [f"emulate.time_scale={scale}"],
                              Path(args.runs) / f"{name}-{scale}")
            steps, final = [r for r in rows if "timing/step_s" in r], rows[-1]
            report["runs"].append({
                "preset": name, "time_scale": float(scale), "overrun_share": final["emulate/overrun_share"],
                "emulating": final["emulate/emulating"], "label": final["emulate/label"],
                "step_s": statistics.mean(r["timing/step_s"] for r in steps),
                "worst_step_overrun_share": max(r["emulate/overrun_share"] for r in steps),
                "wall_s": time.time() - t})
            write_report(args.output, report)
            print(f"[emulate_time_scale] {name} at {scale}: overrun share {final['emulate/overrun_share']:.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
