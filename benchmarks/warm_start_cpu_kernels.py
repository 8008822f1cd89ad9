"""The tiny model a config builds, built again under each of the CPU's kernel sets: one machine, one config,
other weights. rlsys builds and warm-starts the tiny model once per machine (rlsys/models/__init__.py); the warm
start trains on the CPU, and torch picks its kernels by the CPU's instruction set (ATEN_CPU_CAPABILITY forces a
lower one), whose floating-point sums round differently. Each build runs in a process of its own with a fresh
cache; the report gives each one's weights fingerprint (rlsys.models.weights_fingerprint), the warm start's last
loss and its greedy exact-match accuracy on the eval split. A kernel set built twice shows whether a build is
repeatable on one machine.

    python benchmarks/warm_start_cpu_kernels.py --config configs/emulated_h100_7b_cot.yaml \
        --kernels default,avx2,default --output benchmarks/results/warm_start_cpu_kernels_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlsys.bench import machine, write_report  # noqa: E402

BUILD = """
import json, sys, torch
from rlsys.models import BUILD_INFO, prepare_model, weights_fingerprint
from rlsys.startup import load_config
overrides = [f"model.cache_dir={sys.argv[2]}", "logging.progress=false", *sys.argv[3:]]
model_dir = prepare_model(load_config(sys.argv[1], overrides))
info = json.loads((model_dir / BUILD_INFO).read_text())["warm_start"]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "cache_key": model_dir.name,
                  "fingerprint": weights_fingerprint(model_dir), "loss_last": info["loss_last"],
                  "eval_greedy_accuracy": info["eval_greedy_accuracy"], "seconds": info["seconds"]}))
"""


def build(config: str, kernels: str, overrides: list[str]) -> dict:
    """One build in a fresh process and cache; `kernels` "default" leaves torch its own choice."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if kernels != "default":
        env["ATEN_CPU_CAPABILITY"] = kernels
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", BUILD, config, cache, *overrides], env=env, capture_output=True, text=True,
                             check=True)
    return {"kernels": kernels, **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/emulated_h100_7b_cot.yaml")
    p.add_argument("--kernels", default="default,avx2,default", help="ATEN_CPU_CAPABILITY per build, in order")
    p.add_argument("--output", default="benchmarks/results/warm_start_cpu_kernels_cpu.json")
    p.add_argument("overrides", nargs="*", help="key=value on top of the config")
    args = p.parse_args(argv)
    report = {"command": "python benchmarks/warm_start_cpu_kernels.py " + " ".join(argv or sys.argv[1:]),
              "config": args.config, "overrides": args.overrides,
              "machine": machine(), "builds": []}
    for kernels in args.kernels.split(","):
        report["builds"].append(build(args.config, kernels, args.overrides))
        write_report(args.output, report)
        b = report["builds"][-1]
        print(f"[warm start] {kernels} ({b['capability']}): {b['fingerprint']}, greedy accuracy "
              f"{b['eval_greedy_accuracy']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
