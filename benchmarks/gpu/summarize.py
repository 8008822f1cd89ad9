"""A small JSON summary of a GPU run, to bring back from the host: steps, step times, peak GPU memory.

    python benchmarks/gpu/summarize.py RUN_DIR [--gpu-memory-log FILE] [--wall-s SECONDS] > summary.json
The log holds nvidia-smi's memory.used samples in MiB, one a line (run.sh records them): the whole GPU's
peak, as the engine and trainer run in their own processes.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"summarize: {path} not found (did the run start?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def peak_mib(log: Path | None) -> float | None:
    if log is None or not log.is_file():
        return None
    samples = [float(v) for line in log.read_text().splitlines() for v in line.split(",") if v.strip()]
    return max(samples, default=None)


def versions() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def summarize(run_dir: Path, memory_log: Path | None = None, wall_s: float | None = None) -> dict:
    rows = read_rows(run_dir)
    steps = [r for r in rows if "timing/step_s" in r]
    final = next((r for r in reversed(rows) if r.get("final")), {})
    step_s = [round(r["timing/step_s"], 3) for r in steps]
    return {
        "run_dir": str(run_dir), "steps": len(steps), "step_s": step_s,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "train_s": [round(r["timing/train_s"], 3) for r in steps if "timing/train_s" in r],
        "weight_sync_s": [round(r["timing/weight_sync_s"], 3) for r in steps if "timing/weight_sync_s" in r],
        "tokens_per_s": [round(r["throughput/tokens_per_s"], 1) for r in steps if "throughput/tokens_per_s" in r],
        "training_clock_s": rows[-1]["time_s"] if rows else None,  # rlsys's clock: eval and saving left out
        "wall_s": wall_s,  # the whole `rlsys train`: model build, Ray start, evals, export
        "final_eval_accuracy": final.get("eval/accuracy"),
        "peak_gpu_memory_mib": peak_mib(memory_log),
        **versions(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--gpu-memory-log", type=Path)
    parser.add_argument("--wall-s", type=float)
    args = parser.parse_args()
    print(json.dumps(summarize(args.run_dir, args.gpu_memory_log, args.wall_s), indent=1))
