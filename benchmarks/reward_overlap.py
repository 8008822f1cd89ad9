"""What scoring each sample as it finishes saves against scoring the round after it has generated
(docs/design.md "Tail batching": rewards overlap generation), with a reward that costs real time.

    python benchmarks/reward_overlap.py [--steps N] [--repeats R]

The workload is the embedded default on the `math` task (worked fraction sums; warm start on it),
scored by math_verify. Two modes of the real controller, interleaved and repeated:
  overlapped   the default: each completion goes to the reward pool as it arrives;
  after_round  the baseline (ScoreAfterRound): a round's completions go to the pool once it has generated.
Also times math_verify itself per call on this task's answers. Writes
benchmarks/results/reward_overlap_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from rlsys.bench import machine, run_preset
from rlsys.startup import load_config
from rlsys.train import Controller

RESULTS = Path(__file__).resolve().parent / "results" / "reward_overlap_cpu.json"
WORKLOAD = ["data.task=math", "reward.fn=math_verify", "control.eval_every=0", "control.save_every=0",
            "data.eval_size=50", "logging.progress=false"]
METRICS = ("timing/step_s", "timing/reward_s", "timing/rollout_s", "timing/train_s", "reward/mean")


class ScoreAfterRound(Controller):
    """The baseline that overlap is measured against: completions wait, unscored, until none of the run's requests
    is generating, then all go to the reward pool at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held = []

    def score(self, completions) -> None:
        self.held += completions
        # `prompts` holds every request not yet scored: generating, held here, or with the pool (`in_flight`)
        if self.held and len(self.prompts) == len(self.held) + len(self.in_flight):
            held, self.held = self.held, []
            super().score(held)


MODES = {"overlapped": Controller, "after_round": ScoreAfterRound}


def run(mode: str, steps: int, out_dir: Path) -> dict:
    rows = run_preset(None, WORKLOAD + [f"trainer.total_steps={steps}"], out_dir, MODES[mode])
    rows = [r for r in rows if "timing/step_s" in r][1:]  # the first step warms up
    means = {k: statistics.mean(r[k] for r in rows) for k in METRICS}
    # The phase that overlap acts on: from the step's first submit to the groups handed to the trainer.
    means["generate_and_score_s"] = means["timing/rollout_s"] + means["timing/reward_s"]
    return means | {"steps": len(rows), "load_1min_after": os.getloadavg()[0]}


def math_verify_cost(calls: int = 400, seed: int = 0) -> dict:
    """math_verify per call on this task's answers, as the model might write them: right, cut short,
    with a wrong final value, or with one character too many."""
    from rlsys.data import TASKS
    from rlsys.reward.registry import math_verify

    rng = random.Random(seed)
    math_verify("1/2", "1/2")  # imports and grammar loading are a one-off per worker
    times = []
    for _ in range(calls):
        _, answer = TASKS.get("math")(rng)
        response = rng.choice([answer, answer[:-1], answer[:len(answer) // 2],
                               answer.rpartition("=")[0] + f"={rng.randint(1, 99)}", answer + "0"])
        t = time.perf_counter()
        math_verify(response, answer)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"calls": calls, "mean_ms": 1e3 * statistics.mean(times), "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * times[int(0.9 * calls)], "max_ms": 1e3 * times[-1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_reward_overlap")
    args = parser.parse_args(argv)
    start = machine()
    cost = math_verify_cost()
    print(f"math_verify per call: {cost['mean_ms']:.2f} ms mean, {cost['median_ms']:.2f} ms median")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):  # alternate which runs first
            runs[mode].append(run(mode, args.steps, Path(args.out) / f"{mode}-r{r}"))
            print(f"[reward_overlap] {mode} repeat {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[mode][-1].items()))
    cfg = load_config(None, WORKLOAD)
    keys = METRICS + ("generate_and_score_s",)
    summary = {m: {k: statistics.median(x[k] for x in rs) for k in keys} for m, rs in runs.items()}
    base, overlapped = summary["after_round"], summary["overlapped"]
    gain = {k: base[k] / overlapped[k] for k in ("timing/step_s", "generate_and_score_s")}
    result = {
        "workload": {"config": "configs/tiny.yaml", "overrides": WORKLOAD, "total_steps": args.steps,
                     "measured_steps": "all but the first", "repeats": args.repeats,
                     "prompts_per_step": cfg.control.prompts_per_step, "group_size": cfg.control.group_size,
                     "reward_workers": cfg.reward.num_workers, "trainer": cfg.trainer.backend},
        "math_verify_per_call": cost,
        "median_of_repeats": summary,
        "runs": runs,
        "gain": gain,  # after_round time / overlapped time, medians over repeats
        "reward_s_hidden": base["timing/reward_s"] - overlapped["timing/reward_s"],
        "machine": start | {"load_average_at_end": machine()["load_average_at_start"]},
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"step time: overlapped {overlapped['timing/step_s']:.3f}s, after round {base['timing/step_s']:.3f}s "
          f"({gain['timing/step_s']:.2f}x); generate and score: {gain['generate_and_score_s']:.2f}x; "
          f"wrote {RESULTS.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
