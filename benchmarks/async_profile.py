"""Where an async step's time goes on this machine: the CPU each process of a live run uses, and the
trainer's idle gap between train steps.

Runs `rlsys train` with the given overrides, reads /proc over a window in the middle of the run (CPU time of
every process: the controller, the Ray actors by their task names, Ray's own daemons), and takes the medians
of the step's timings after the first steps. Linux only.

    python benchmarks/async_profile.py --output benchmarks/results/async_profile_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlsys.bench import machine, write_report  # noqa: E402
from rlsys.logger import read_jsonl  # noqa: E402

CONDITIONS = {
    "async-loglinear": ["control.scheduler=async", "trainer.loss=decoupled_ppo", "trainer.proximal=loglinear"],
    "sync": [],
}
TIMINGS = ["timing/step_s", "timing/train_s", "timing/rollout_s", "timing/weight_sync_s"]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) for every process readable now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = args[0].decode(errors="replace") if args and args[0] else stat[stat.index("(") + 1:stat.rindex(")")]
        if "rlsys.cli" in " ".join(a.decode(errors="replace") for a in args):
            name = "controller"
        out[int(entry.name)] = (name.split(".")[0] if name.startswith("ray::") else Path(name).name,
                                (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def profile(overrides: list[str], steps: int, start: int, window_s: float, out_dir: Path) -> dict:
    run = out_dir / "run"
    cmd = [sys.executable, "-m", "rlsys.cli", "train", "rlsys/configs/tiny.yaml", f"trainer.total_steps={steps}",
           "control.eval_every=0", "control.save_every=0", f"output_dir={run}", "logging.progress=false", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while not any(r.get("step", 0) >= start and "timing/step_s" in r for r in read_jsonl(run / "metrics.jsonl")):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before step {start}: {' '.join(cmd)}")
            time.sleep(0.5)
        before, t0 = cpu_seconds(), time.time()
        time.sleep(window_s)
        after, elapsed = cpu_seconds(), time.time() - t0
        if proc.wait(timeout=1800):
            raise RuntimeError(f"the run failed: {' '.join(cmd)}")
    finally:
        if proc.poll() is None:
            proc.kill()
    cores: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        if pid in before and before[pid][0] == name:
            cores[name] = cores.get(name, 0.0) + (seconds - before[pid][1]) / elapsed
    busy = {k: round(v, 3) for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.005}
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "timing/step_s" in r and r["step"] > start]
    timings = {k.split("/")[1]: round(statistics.median(r[k] for r in rows), 4) for k in TIMINGS}
    return {"cores_in_window": busy, "cores_total": round(sum(cores.values()), 3), "window_s": round(elapsed, 1),
            "steps_after": start, "median": timings,
            "trainer_idle_between_steps_s": round(timings["step_s"] - timings["train_s"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--start", type=int, default=20, help="the window opens once this step is logged")
    ap.add_argument("--window", type=float, default=30.0, help="seconds of CPU accounting")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    report = {"command": "python " + " ".join(sys.argv), "machine": machine(), "results": {}}
    for name in args.conditions.split(","):
        report["results"][name] = profile(CONDITIONS[name], args.steps, args.start, args.window,
                                          ROOT / "runs" / "async_profile" / name)
        print(name, json.dumps(report["results"][name]), flush=True)
    write_report(args.output, report)


if __name__ == "__main__":
    main()
