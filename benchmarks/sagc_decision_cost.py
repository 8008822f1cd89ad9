"""What SAGC costs the controller per step (docs/design.md "SAGC": the decision must cost well under 1 ms).

    python benchmarks/sagc_decision_cost.py [--steps N] [--prompts P] [--group-size G]

Times `next_shape()` + `observe()` over many steps of scripted groups (a production-sized step by
default: 128 prompts x 8 samples, kept constant by the `constant_samples` rule), and apart from that
the decision alone (the argmax over allowed sizes). Writes benchmarks/results/sagc_decision_cost.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from rlsys.config import ControlConfig
from rlsys.control.sagc import SAGCSizer
from rlsys.types import Completion, Group, Prompt, ScoredSample

RESULTS = Path(__file__).resolve().parent / "results" / "sagc_decision_cost.json"
VARIANTS = 20  # scripted steps per group size, reused in turn


def scripted_steps(cfg: ControlConfig, seed: int = 0) -> dict[int, list[list[Group]]]:
    """Groups whose lengths have a 2% share of samples 4x the typical length, so sizes really change."""
    rng, prompt = random.Random(seed), Prompt("train-0", "q", "a")

    def sample() -> ScoredSample:
        n = 400 if rng.random() < 0.02 else rng.randint(80, 120)
        return ScoredSample(Completion("r", prompt.uid, [], [0] * n, [], [], "stop"), float(rng.random() < 0.5))

    steps = {}
    for g in cfg.sagc.sizes:
        prompts = max(1, round(cfg.prompts_per_step * cfg.group_size / g))  # the constant_samples rule
        steps[g] = [[Group(prompt, [sample() for _ in range(g)]) for _ in range(prompts)] for _ in range(VARIANTS)]
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args(argv)
    cfg = ControlConfig(group_sizer="sagc", prompts_per_step=args.prompts, group_size=args.group_size)
    steps = scripted_steps(cfg)
    sizer = SAGCSizer(cfg)

    gc.disable()  # as timeit does: collector pauses belong to the whole process, not to SAGC
    per_step, sizes, samples = [], [], 0
    for i in range(args.steps):
        t = time.perf_counter()
        shape = sizer.next_shape()
        groups = steps[shape.group_size][i % VARIANTS]
        sizer.observe(groups)
        per_step.append(time.perf_counter() - t)
        sizes.append(shape.group_size)
        samples += shape.prompts * shape.group_size

    decide = []
    for _ in range(args.steps):
        t = time.perf_counter()
        sizer._decide()  # the argmax alone, which observe() runs at its end
        sizer.next_shape()
        decide.append(time.perf_counter() - t)
    gc.enable()

    result = {
        "steps": args.steps,
        "samples_per_step": samples / args.steps,
        "allowed_sizes": cfg.sagc.sizes,
        "step_mean_ms": statistics.mean(per_step) * 1e3,
        "step_median_ms": statistics.median(per_step) * 1e3,
        "step_min_ms": min(per_step) * 1e3,
        "step_p99_ms": sorted(per_step)[int(0.99 * len(per_step))] * 1e3,
        "decision_mean_us": statistics.mean(decide) * 1e6,
        "group_size_share": {g: sizes.count(g) / len(sizes) for g in cfg.sagc.sizes},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1min": os.getloadavg()[0]},  # other work on the machine inflates the mean
    }
    print(f"next_shape() + observe(): {result['step_mean_ms']:.3f} ms mean, {result['step_median_ms']:.3f} ms median, "
          f"{result['step_min_ms']:.3f} ms min, {result['step_p99_ms']:.3f} ms p99 "
          f"per step ({result['samples_per_step']:.0f} samples per step, {args.steps} steps)")
    print(f"decision alone (argmax over {len(cfg.sagc.sizes)} sizes): {result['decision_mean_us']:.2f} us mean")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
