"""Check the simulator against RollPacker's published figures (CALIBRATION.md §5).

    python benchmarks/sim_calibration.py [--output FILE.json]

Anchors: veRL rollout time per step 82 s (8k) and 673 s (32k); tail batching's end-to-end speedup
over veRL 1.30x (Qwen2.5-7B/8k) and 2.21x (Qwen2.5-32B/32k). The speedups need the `tail` scheduler.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlsys.sim.run import simulate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"
ANCHORS = {  # config: (sync rollout seconds, tail speedup over sync)
    "qwen7b_8k": (82.0, 1.30),
    "qwen32b_32k": (673.0, 2.21),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the comparison as JSON")
    args = parser.parse_args(argv)
    rows = {}
    for name, (rollout, speedup) in ANCHORS.items():
        results = simulate(CONFIGS / f"{name}.yaml")["results"]
        sync, tail = results["sync"], results.get("tail")
        rows[name] = {
            "sync_rollout_s": sync["rollout_time_s"], "paper_rollout_s": rollout,
            "sync_rollout_share": sync["rollout_time_s"] / sync["step_time_s"],
            "tail_speedup": tail["speedup_vs_sync"] if tail else None, "paper_tail_speedup": speedup,
        }
    print(f"\n{'config':<12} {'rollout s (paper)':>18} {'rollout share':>14} {'tail speedup (paper)':>21}")
    for name, r in rows.items():
        got = f"{r['tail_speedup']:.2f}x" if r["tail_speedup"] else "n/a"
        print(f"{name:<12} {r['sync_rollout_s']:>9.0f} ({r['paper_rollout_s']:.0f}) {r['sync_rollout_share']:>14.0%} "
              f"{got:>12} ({r['paper_tail_speedup']:.2f}x)")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
