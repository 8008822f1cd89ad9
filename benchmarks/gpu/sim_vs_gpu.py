"""The simulator beside a run on a real GPU: fed the run's own lengths (timeline.jsonl) and schedule, with the
built-in engine's cost profile (rlsys/costs.py BUILTIN_ENGINE, fitted to its decode grid on that GPU), it predicts
the run's step time, rollout time and bubble ratio (rlsys/sim/replay.py live_vs_sim).

    python benchmarks/gpu/sim_vs_gpu.py RUN_DIR [RUN_DIR ...] --gpu h100 [--step-cost-from-run]

With --step-cost-from-run the engine's fixed cost a step is the run's own (its median rollout/decode_step_ms,
less what the profile charges a step of its batch for its work), the rest of the profile kept: what differs
then is the replay of the schedule, not the engine's speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlsys import costs  # noqa: E402
from rlsys.config import read_config  # noqa: E402
from rlsys.logger import read_jsonl  # noqa: E402
from rlsys.sim.replay import FIGURES, built_model_shape, live_vs_sim  # noqa: E402


def run_step_cost(run: Path, gpu: str) -> dict:
    """costs.BUILTIN_ENGINE with its fixed cost a step moved to what the run measured: the median of its steps'
    rollout/decode_step_ms, against the profile's step for a full batch at the run's mean length, its longest
    sequence halfway through the longest response."""
    cfg = read_config(run / "config.yaml")[0]
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if "rollout/decode_step_ms" in r]
    measured_s = statistics.median(r["rollout/decode_step_ms"] for r in steps) / 1e3
    max_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    engine = costs.EngineCost.build(built_model_shape(cfg), costs.GPUS[gpu], tp=1, **costs.BUILTIN_ENGINE,
                                    max_len=max_len)
    running = min(cfg.rollout.slots, cfg.control.prompts_per_step * cfg.control.group_size)
    context = statistics.mean(r["response_length/mean"] for r in steps) / 2 + cfg.data.max_prompt_tokens / 2
    longest = statistics.mean(r["response_length/max"] for r in steps) / 2 + cfg.data.max_prompt_tokens
    modelled_s = engine.step_s(running, running * context, longest)
    return dict(costs.BUILTIN_ENGINE, overhead_s=costs.BUILTIN_ENGINE["overhead_s"] + measured_s - modelled_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--step-cost-from-run", action="store_true",
                    help="the engine's fixed cost a step from each run's own decode steps")
    args = ap.parse_args()
    out = {}
    for run in args.run_dirs:
        name = run.parent.name if run.name == "run" else run.name  # run.sh's folders: NAME/run
        engine = run_step_cost(run, args.gpu) if args.step_cost_from_run else None
        out[name] = r = live_vs_sim(run, gpu=args.gpu, engine=engine)
        if engine:
            r["engine_overhead_ms"] = round(engine["overhead_s"] * 1e3, 2)
        print(f"{run}: " + ", ".join(f"{f} live {r[f]['live']:.2f} sim {r[f]['sim']:.2f}" for f in FIGURES),
              file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
