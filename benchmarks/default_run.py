"""The default run, measured: `rlsys train` on the default config, timed as a whole command, its evals (with
their standard errors) and what evaluation cost, written as one results file.

    python benchmarks/default_run.py --output benchmarks/results/default_run_cpu.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlsys.bench import machine
from rlsys.logger import read_jsonl


def summarise(rows: list[dict], whole_command_s: float) -> dict:
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "timing/step_s" in r]
    eval_s = sum(r.get("timing/eval_s", 0.0) for r in evals)
    clock = steps[-1]["time_s"] if steps else 0.0
    keep = ("step", "time_s", "eval/accuracy", "eval/accuracy_se", "eval/greedy_accuracy", "eval/greedy_accuracy_se")
    return {"evals": [{k: r[k] for k in keep if k in r} for r in evals],
            "training_clock_s": clock, "eval_s": eval_s,
            "eval_share_of_run": eval_s / (clock + eval_s) if clock + eval_s else None,
            "reward_first_10_steps": sum(r["reward/mean"] for r in steps[:10]) / max(len(steps[:10]), 1),
            "reward_last_10_steps": sum(r["reward/mean"] for r in steps[-10:]) / max(len(steps[-10:]), 1),
            "whole_command_s": whole_command_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the default config")
    p.add_argument("--output", help="write the results JSON here")
    args = p.parse_args(argv)
    start = machine()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rlsys.cli", "train", *args.overrides, f"output_dir={tmp}/run",
               "logging.progress=false"]
        t = time.time()
        subprocess.run(cmd, check=True)
        report = summarise(read_jsonl(Path(tmp) / "run" / "metrics.jsonl"), time.time() - t)
    report = {"command": "python benchmarks/default_run.py " + " ".join(args.overrides), "machine": start, **report}
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
