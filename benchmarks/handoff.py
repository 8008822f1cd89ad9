"""What handing finished completions over together saves (`rollout.handoff_s`), under sync and async.

Each Ray call that brings completions to the controller, and each reward call, costs the rollout worker's
process CPU, which on a small machine its decoding needs. Runs each schedule with the hand-over as each
completion is ready (`rollout.handoff_s=0`) and held up to 0.05 s (the default), interleaved and repeated,
and reports the medians of the step timings after the first steps, and each repeat's pair ratio.

    python benchmarks/handoff.py --output benchmarks/results/handoff_cpu.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlsys.bench import PRESETS, machine, pair_ratios, run_preset, write_report  # noqa: E402

SCHEDULES = ("sync", "async-loglinear")
HANDOFFS = {"each_ready": 0.0, "held": 0.05}
TIMINGS = ("timing/step_s", "timing/rollout_s", "timing/train_s")


def medians(rows: list[dict], after: int) -> dict:
    rows = [r for r in rows if "timing/step_s" in r and r["step"] > after]
    return {k.split("/")[1]: round(statistics.median(r[k] for r in rows), 4) for k in TIMINGS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--after", type=int, default=10, help="timings from the steps after this one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    report = {"command": "python " + " ".join(sys.argv), "machine": machine(), "runs": {}, "pairs": {}}
    conditions = [(s, h) for s in SCHEDULES for h in HANDOFFS]
    runs = report["runs"] = {f"{s}/{h}": [] for s, h in conditions}
    for r in range(args.repeats):
        n = r % len(conditions)
        for s, h in conditions[n:] + conditions[:n]:  # rotated: no condition always runs first
            overrides = PRESETS[s] + [f"trainer.total_steps={args.steps}", "control.eval_every=0",
                                      "control.save_every=0", f"rollout.handoff_s={HANDOFFS[h]}"]
            runs[f"{s}/{h}"].append(medians(run_preset(None, overrides, ROOT / "runs" / "handoff" / f"{s}-{h}"),
                                            args.after))
            print(f"[handoff] {s}/{h} repeat {r}: {runs[f'{s}/{h}'][-1]}", flush=True)
            write_report(args.output, report)
    for s in SCHEDULES:  # how much faster each step is with completions held: each repeat's pair
        report["pairs"][f"{s}: each_ready / held"] = pair_ratios(runs[f"{s}/each_ready"], runs[f"{s}/held"], "step_s")
    for h in HANDOFFS:  # async's gain over sync per step, as the bench measures it per sample
        report["pairs"][f"{h}: sync / async-loglinear"] = pair_ratios(runs[f"sync/{h}"], runs[f"async-loglinear/{h}"],
                                                                      "step_s")
    report["pairs"] = {k: {"median": round(statistics.median(v), 3), "each": [round(x, 3) for x in v]}
                       for k, v in report["pairs"].items()}
    print(report["pairs"])
    write_report(args.output, report)


if __name__ == "__main__":
    main()
