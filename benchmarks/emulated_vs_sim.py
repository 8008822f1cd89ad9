"""The simulator checked against the live system on an emulated clock: for each preset, a short live run with
`emulate` on, then the simulator fed that run's own lengths (its timeline.jsonl) and the same cost model
(rlsys/sim/replay.py); their step time, rollout time and bubble ratio side by side. The report is rewritten
after every preset, so a sweep cut short keeps what it measured.

    python benchmarks/emulated_vs_sim.py --presets sync,tail --steps 6
    python benchmarks/emulated_vs_sim.py --presets sorted,async --steps 6 --top-up   # more presets, same file
    python benchmarks/emulated_vs_sim.py --bench runs/bench --output FILE   # replay every run of an `rlsys bench`
    python benchmarks/emulated_vs_sim.py --budget-runs runs/emulated_budget/longcot32-2gpu --output FILE
        # every complete run of `rlsys bench --budgets`'s folders (PRESET-sSEED)
    python benchmarks/emulated_vs_sim.py --budget-runs runs/emulated_budget/old-2gpu --output FILE --top-up
        # the presets run again there replace theirs in FILE; the other presets' replays are kept
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlsys.bench import PRESETS, machine, run_preset, write_report  # noqa: E402
from rlsys.config import read_config  # noqa: E402
from rlsys.logger import read_jsonl  # noqa: E402
from rlsys.sim.replay import FIGURES, live_vs_sim  # noqa: E402
from rlsys.startup import load_config  # noqa: E402

CONFIG = "configs/emulated_h100_7b.yaml"


def replay_bench(bench_dir: Path, output: str, command: str) -> int:
    """The simulator beside every run of an `rlsys bench` folder (PRESET-rN)."""
    found = {}
    for run_dir in sorted(bench_dir.iterdir()):
        preset = re.fullmatch(r"(.+)-r\d+", run_dir.name)
        if preset and (run_dir / "timeline.jsonl").exists():
            found[run_dir] = preset[1]
    return replay_runs(found, {"bench": str(bench_dir)}, output, command)


def complete(run_dir: Path) -> bool:
    """A run with a timeline whose metrics reached its last step (trainer.total_steps)."""
    if not (run_dir / "timeline.jsonl").exists() or not (run_dir / "config.yaml").exists():
        return False
    try:
        steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/step_s" in r]
    except json.JSONDecodeError:  # a run still writing its last line
        return False
    return bool(steps) and max(steps) >= read_config(run_dir / "config.yaml")[0].trainer.total_steps


def replay_budget_runs(folders: list[Path], output: str, command: str, top_up: bool = False) -> int:
    """The simulator beside every complete run of `rlsys bench --budgets`'s folders (PRESET-sSEED); a run
    complete in more than one folder is taken from the last. `top_up`: a preset found there replaces all of its
    seeds in the output, whose other presets are kept (their folders may be gone)."""
    found = {}
    for folder in folders:
        for run_dir in sorted(folder.iterdir()):
            preset = re.fullmatch(r"(.+)-s\d+", run_dir.name)
            if preset and complete(run_dir):
                found[run_dir.name] = (run_dir, preset[1])
    before = json.loads(Path(output).read_text()) if top_up and Path(output).exists() else None
    return replay_runs(dict(sorted(found.values())), {"folders": [str(f) for f in folders]}, output, command,
                       before)


def replay_runs(found: dict[Path, str], where: dict, output: str, command: str, before: dict | None = None) -> int:
    """Per run (`found`: its folder and preset), and per preset the median and [min, max] of sim/live over its
    seeds (the live figures' mean beside them). `before`: a report whose presets not in `found` are kept, in its
    order."""
    runs: dict[str, list[dict]] = {}
    for run_dir, preset in found.items():
        row = dict(live_vs_sim(run_dir), run=run_dir.name, folder=str(run_dir.parent))
        runs.setdefault(preset, []).append(row)
    if before:
        runs = {**{p: runs.get(p, rs) for p, rs in before["runs"].items()}, **runs}
        where = {k: list(dict.fromkeys(before.get(k, []) + v)) for k, v in where.items()}
        command = before["command"] + "; then " + command
    report = {"command": command, **where, "machine": machine(), "runs": runs, "results": {}}
    for preset, rs in runs.items():
        out = {"seeds": len(rs), "overrun_share": max(r["overrun_share"] for r in rs),
               "emulating": all(r["emulating"] for r in rs), "gpus": rs[0]["gpus"]}
        for figure in [f for f in (*FIGURES, "gpu_s_per_sample") if all(f in r for r in rs)]:
            ratios = [r[figure]["sim_over_live"] for r in rs]
            out[figure] = {"live": statistics.fmean(r[figure]["live"] for r in rs),
                           "sim": statistics.fmean(r[figure]["sim"] for r in rs),
                           "sim_over_live": statistics.median(ratios), "sim_over_live_spread": [min(ratios), max(ratios)]}
        report["results"][preset] = out
        print(f"[emulated_vs_sim] {preset} ({len(rs)} seeds): " + ", ".join(
            f"{f} sim/live {out[f]['sim_over_live']:.2f}" for f in FIGURES), flush=True)
    write_report(output, report)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--presets", default="sync,tail")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", default="runs/emulated_vs_sim", help="folder for the live runs")
    p.add_argument("--output", default="benchmarks/results/emulated_vs_sim_cpu.json")
    p.add_argument("--top-up", action="store_true",
                   help="keep the output's other presets: rerun (with --budget-runs, replay) only these")
    p.add_argument("--replay-only", action="store_true", help="simulate the live runs already in --runs again")
    p.add_argument("--bench", help="instead: replay every run of this `rlsys bench` --out-dir")
    p.add_argument("--budget-runs", nargs="+", help="instead: replay every complete run (PRESET-sSEED) of these "
                   "`rlsys bench --budgets` folders, the last folder's where two hold one")
    p.add_argument("overrides", nargs="*", help="key=value on top of the config")
    args = p.parse_args(argv)
    if args.budget_runs:
        return replay_budget_runs([Path(f) for f in args.budget_runs], args.output,
                                  "python benchmarks/emulated_vs_sim.py " + " ".join(argv or sys.argv[1:]),
                                  args.top_up)
    if args.bench:
        return replay_bench(Path(args.bench), args.output,
                            "python benchmarks/emulated_vs_sim.py " + " ".join(argv or sys.argv[1:]))
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
        if not args.replay_only:
            run_preset(args.config, common + PRESETS[name], run_dir)
        wall_s = report["results"].get(name, {}).get("wall_s") if args.replay_only else time.time() - t
        report["results"][name] = dict(live_vs_sim(run_dir), wall_s=wall_s)  # wall_s: the live run's
        write_report(args.output, report)
        r = report["results"][name]
        print(f"[emulated_vs_sim] {name}: " + ", ".join(
            f"{f} live {r[f]['live']:.2f} sim {r[f]['sim']:.2f}" for f in FIGURES)
            + f"; overrun share {r['overrun_share']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
