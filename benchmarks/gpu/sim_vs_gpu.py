"""The simulator beside a run on a real GPU: fed the run's own lengths (timeline.jsonl) and schedule, with the
built-in engine's cost profile (rlsys/costs.py BUILTIN_ENGINE, fitted to its decode grid on that GPU), it predicts
the run's step time, rollout time and bubble ratio (rlsys/sim/replay.py live_vs_sim).

    python benchmarks/gpu/sim_vs_gpu.py RUN_DIR [RUN_DIR ...] --gpu h100
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlsys.sim.replay import FIGURES, live_vs_sim  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--gpu", required=True)
    args = ap.parse_args()
    out = {}
    for run in args.run_dirs:
        name = run.parent.name if run.name == "run" else run.name  # run.sh's folders: NAME/run
        out[name] = r = live_vs_sim(run, gpu=args.gpu)
        print(f"{run}: " + ", ".join(f"{f} live {r[f]['live']:.2f} sim {r[f]['sim']:.2f}" for f in FIGURES),
              file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
