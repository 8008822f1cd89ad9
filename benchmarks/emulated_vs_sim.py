"""The simulator checked against the live system on an emulated clock: for each preset, a short live run with
`emulate` on, then the simulator fed that run's own lengths (its timeline.jsonl) and the same cost model
(rlsys/sim/replay.py); their step time, rollout time and bubble ratio side by side. The report is rewritten
after every preset, so a sweep cut short keeps what it measured.

    python benchmarks/emulated_vs_sim.py --presets sync,tail --steps 6
    python benchmarks/emulated_vs_sim.py --presets sorted,async --steps 6 --top-up   # more presets, same file
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlsys.bench import PRESETS, machine, run_preset, write_report  # noqa: E402
from rlsys.logger import read_jsonl  # noqa: E402
from rlsys.sim.replay import replay_config  # noqa: E402
from rlsys.sim.simulator import Simulation  # noqa: E402
from rlsys.startup import load_config  # noqa: E402

CONFIG = "configs/emulated_h100_7b.yaml"
# figure -> (live metric, simulator's figure): both bubbles over the steps' rollout windows (rlsys/step_stats.py)
FIGURES = {"step_time_s": ("timing/step_s", "step_time_s"), "rollout_time_s": ("timing/rollout_s", "rollout_time_s"),
           "bubble_ratio": ("rollout/bubble_ratio", "rollout_bubble_ratio")}


def compare(run_dir: Path, rows: list[dict]) -> dict:
    steps = [r for r in rows if "timing/step_s" in r]
    cfg, workload = replay_config(run_dir, steps=len(steps))
    sim = Simulation(cfg, cfg.runs()[0], workload).run()
    out = {}
    for figure, (key, sim_key) in FIGURES.items():
        live = statistics.mean(r[key] for r in steps)
        if figure == "bubble_ratio":  # the simulator's is over all windows together, so the steps' weighted by theirs
            live = sum(r[key] * r["timing/rollout_s"] for r in steps) / sum(r["timing/rollout_s"] for r in steps)
        out[figure] = {"live": live, "sim": sim[sim_key], "sim_over_live": sim[sim_key] / live if live else None}
    final = rows[-1]
    out["overrun_share"] = final.get("emulate/overrun_share")
    out["emulating"] = final.get("emulate/emulating")
    out["live_train_time_s"] = statistics.mean(r["timing/train_s"] for r in steps)
    out["sim_train_time_s"] = sim["train_time_s"]
    out["live_weight_sync_s"] = statistics.mean(r["timing/weight_sync_s"] for r in steps)
    out["sim_weight_sync_s"] = sim["weight_sync_s"]
    # what a live step spent outside its rollout window, reward wait, training and weight publish: unpaced work
    out["live_unaccounted_s"] = statistics.mean(r["timing/step_s"] - sum(r[f"timing/{part}_s"] for part in
                                                ("rollout", "reward", "train", "weight_sync")) for r in steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--presets", default="sync,tail")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", default="runs/emulated_vs_sim", help="folder for the live runs")
    p.add_argument("--output", default="benchmarks/results/emulated_vs_sim_cpu.json")
    p.add_argument("--top-up", action="store_true", help="keep the output's other presets, rerun only these")
    p.add_argument("--replay-only", action="store_true", help="simulate the live runs already in --runs again")
    p.add_argument("overrides", nargs="*", help="key=value on top of the config")
    args = p.parse_args(argv)
    common = [f"trainer.total_steps={args.steps}", "control.eval_every=0", "control.save_every=0",
              "data.eval_size=32", *args.overrides]
    cfg = load_config(args.config, common)
    report = {"command": "python benchmarks/emulated_vs_sim.py " + " ".join(argv or sys.argv[1:]),
              "config": args.config, "overrides": common, "machine": machine(),
              "clock": f"emulated {cfg.emulate.gpu}/{cfg.emulate.model}", "emulate": cfg.emulate.model_dump(),
              "results": {}}
    if args.top_up and Path(args.output).exists():
        before = json.loads(Path(args.output).read_text())
        if before["overrides"] != common:
            p.error(f"--top-up: {args.output} was measured with other overrides ({before['overrides']})")
        report["results"] = before["results"]
        report["command"] = before["command"] + "; then " + report["command"]
    for name in args.presets.split(","):
        t = time.time()
        run_dir = Path(args.runs) / name
        rows = (read_jsonl(run_dir / "metrics.jsonl") if args.replay_only
                else run_preset(args.config, common + PRESETS[name], run_dir))
        wall_s = report["results"].get(name, {}).get("wall_s") if args.replay_only else time.time() - t
        report["results"][name] = dict(compare(run_dir, rows), wall_s=wall_s)  # wall_s: the live run's
        write_report(args.output, report)
        r = report["results"][name]
        print(f"[emulated_vs_sim] {name}: " + ", ".join(
            f"{f} live {r[f]['live']:.2f} sim {r[f]['sim']:.2f}" for f in FIGURES)
            + f"; overrun share {r['overrun_share']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
