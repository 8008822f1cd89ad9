"""`rlsys simulate CONFIG [--output FILE.json]`: compare schedulers on a simulated GPU cluster."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Union

from rlsys.config import ConfigError
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.sim.config import SimConfig, load_sim_config
from rlsys.sim.simulator import Simulation
from rlsys.sim.workload import Workload

REFERENCE = "sync"


def simulate(config: Union[str, Path, dict, SimConfig], output: Optional[Union[str, Path]] = None,
             quiet: bool = False) -> dict:
    """Run every scheduler the config lists; returns (and writes, if `output`) the figures as a dict."""
    cfg = load_sim_config(config)
    say = (lambda *a: None) if quiet else print
    results, skipped = {}, {}
    workload = Workload(cfg.workload, cfg.reward, cfg.seed)  # the same prompts and samples for all
    for run in cfg.runs():
        control = cfg.control_for(run)
        missing = [f"{kind} {name!r}" for kind, name, reg in (
            ("scheduler", control.scheduler, SCHEDULERS), ("group sizer", control.group_sizer, GROUP_SIZERS))
            if name not in reg]
        if missing:  # schedulers arrive in the registry over time; configs may list them ahead
            skipped[run.label] = f"unknown {', '.join(missing)}"
            say(f"note: skipping {run.label}: unknown {', '.join(missing)}")
            continue
        results[run.label] = Simulation(cfg, run, workload).run()
    reference = results.get(REFERENCE)
    for figures in results.values():
        figures["speedup_vs_sync"] = reference["step_time_s"] / figures["step_time_s"] if reference else None
    report = {"name": cfg.name, "seed": cfg.seed, "steps": cfg.steps, "results": results, "skipped": skipped}
    say(format_table(report))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2) + "\n")
        say(f"wrote {output}")
    return report


COLUMNS = [  # header, key, format
    ("scheduler", None, "{}"), ("step s", "step_time_s", "{:.1f}"), ("rollout s", "rollout_time_s", "{:.1f}"),
    ("train s", "train_time_s", "{:.1f}"), ("bubble", "bubble_ratio", "{:.2f}"),
    ("straggler", "straggler_rate", "{:.2f}"), ("tok/s", "tokens_per_s", "{:,.0f}"),
    ("ctrl %", None, "{:.4f}"), ("speedup", "speedup_vs_sync", "{:.2f}x"), ("wall s", None, "{:.1f}"),
]


def format_table(report: dict) -> str:
    rows = [[h for h, _, _ in COLUMNS]]
    for label, r in report["results"].items():
        row = []
        for header, key, fmt in COLUMNS:
            value = {"scheduler": label, "ctrl %": 100 * r["wall"]["controller_share"],
                     "wall s": r["wall"]["run_s"]}.get(header, r.get(key) if key else None)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return f"{report['name']}: {report['steps']} steps, seed {report['seed']}\n" + "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="a simulator workload config, e.g. configs/sim/qwen7b_8k.yaml")
    parser.add_argument("--output", "-o", help="write the figures as JSON to this file")


def run_from_args(args: argparse.Namespace) -> int:
    if args.config is None:
        raise ConfigError("a simulator config, e.g. configs/sim/qwen7b_8k.yaml (or `rlsys simulate --calibrate`, "
                          "the simulator against the published papers)")
    simulate(args.config, args.output)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsys simulate", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except ConfigError as e:
        print(f"rlsys simulate: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
