"""Every preset on one GPU budget (issue 45): the emulated comparison rerun at an equal budget of modelled GPUs.

Each budget B runs every preset on B modelled H100s (emulate.gpus=B). Colocated (one engine per GPU, the trainer
on all of them, contending with the engines where they overlap): sync, tail, tail-streamed, sorted,
sorted-partial, sagc, async, async-eta2. Split (B/2 engine GPUs, the trainer on the other B/2): async-split and
async-eta2-split. Per (workload, budget) one results file, benchmarks/results/emulated_budget_<workload>_<B>gpu.json,
rewritten after every run in `rlsys bench`'s report format (GPU-seconds, ratios with bootstrap 95% intervals).
Resumable: a (preset, seed) already in the file is not run again, so the matrix grows over several sessions, and
several processes may fill one file side by side (give each its own seeds or presets: each run is added to the
file as it is then, under a lock); one that did not emulate (its real compute overran, e.g. on a loaded machine)
is kept, left out of the figures, and run again. Every run must start from the file's model: the tiny model is
built once per machine, and another CPU can warm-start it to other weights (benchmarks/warm_start_cpu_kernels.py).
A machine that builds another model than the file's runs logged is refused before it runs; a run from before
fingerprints whose step-0 accuracy differs from the file's first run's is kept under `other_start`, left out.

    nice -n 5 python benchmarks/emulated_budget.py --workloads old --budgets 2 --presets sync,tail --seeds 3
    nice -n 5 python benchmarks/emulated_budget.py --workloads longcot --budgets 2 --presets sync,tail --seeds 2
    python benchmarks/emulated_budget.py                     # the whole matrix, 5 seeds, skipping what is done
    python benchmarks/emulated_budget.py --seeds 5 --first-seed 3   # seeds 3 and 4 only, beside another process
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlsys.bench import (PRESETS, Target, add_equal_time, aggregate, budget_gpus, machine, median_of,  # noqa: E402
                         run_config, run_loaded, same_start, speedups, started_elsewhere, summarise_run,
                         write_report)
from rlsys.config import Config  # noqa: E402
from rlsys.startup import load_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# name -> config; every run as long as the stored emulated table's (its overrides and target); time to target is
# interpolated between evals
# (old: the default task mix; longcot: cot_sum, whose answers lengthen as the policy learns, long-CoT RL's shape)
SHORT = ["trainer.total_steps=20", "control.eval_every=5", "data.eval_size=1000", "control.save_every=0"]
# longcot's steps grow as its answers do: 10 steps and evals of 500 fit two seeds of two presets in half an hour
LONGCOT_SHORT = ["trainer.total_steps=10", "control.eval_every=5", "data.eval_size=500", "control.save_every=0"]
# longcot32: longcot as first run, before its engines got the slots their modelled KV holds
WORKLOADS = {"old": ("configs/emulated_h100_7b.yaml", SHORT),
             "longcot": ("configs/emulated_h100_7b_cot.yaml", LONGCOT_SHORT),
             "longcot32": ("configs/emulated_h100_7b_cot.yaml", LONGCOT_SHORT + ["rollout.slots=32"])}
TARGET = "+0.03"  # the stored table's
COLOCATED = ["sync", "tail", "tail-streamed", "tail-scaledown", "sorted", "sorted-partial", "sagc", "async", "async-eta2"]
SPLIT = {"async-split": "async", "async-eta2-split": "async-eta2"}
CLOCK = "emulated H100s running Qwen2.5-7B (CPU: the tiny model's real tokens on this machine, paced by rlsys/costs.py)"


# Wall seconds per emulated second, per modelled GPU: this machine's two cores do every modelled GPU's work, so the
# clock slows as the budget grows (0.25 at two GPUs, the configs' own scale)
TIME_SCALE_PER_GPU = 0.125


def layout(preset: str, gpus: int) -> list[str]:
    """The overrides that put a preset on `gpus` modelled GPUs: colocated one engine each, or split in halves."""
    budget = [f"emulate.gpus={gpus}", f"emulate.time_scale={TIME_SCALE_PER_GPU * gpus:g}"]
    if preset in SPLIT:
        return PRESETS[SPLIT[preset]] + budget + ["emulate.layout=separate", f"rollout.num_workers={gpus // 2}"]
    return PRESETS[preset] + budget + ["emulate.layout=colocated", f"rollout.num_workers={gpus}"]


def first_run(runs: dict[str, list[dict]]) -> dict | None:
    """The run the file's others must start alike with (same_start): sync's first, else the file's first."""
    return next(iter(runs.get("sync") or [r for v in runs.values() for r in v]), None)


def report_of(workload: dict, runs: dict[str, list[dict]], command: str) -> dict:
    """The bench report over the runs that emulated (overrun share within emulate.overrun_limit), paired with
    sync by seed; a run that did not emulate stays in `runs`, is named in `not_emulating`, and is run again. A
    run that started from another model than the file's first (same_start) stays in `runs`, is named in
    `other_start`, and is left out: the file is to be measured again whole, on one machine."""
    order = COLOCATED + list(SPLIT)  # one order whichever process wrote first: a preset's row stays in its place
    runs = dict(sorted(runs.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))
    first = first_run(runs)
    kept, unlike = {}, []
    for n, v in runs.items():  # each run tested itself: a preset may hold two runs of one seed (one not emulating)
        for r in sorted(v, key=lambda r: r["seed"]):
            if not same_start(r, first):
                unlike.append([n, r["seed"]])
            elif r.get("emulating", True):
                kept.setdefault(n, []).append(r)
    if "sync" in kept:  # pairs only where both ran that seed
        seeds = {r["seed"] for r in kept["sync"]}
        paired = {n: [r for r in v if r["seed"] in seeds] for n, v in kept.items()}
        paired = {n: v for n, v in paired.items() if v}
    else:
        paired = kept
    equal_time_s = add_equal_time(kept) if kept else None  # before aggregating: it adds each run's accuracy at it
    results = {n: aggregate(v) for n, v in kept.items()}
    return {"command": command, "workload": workload, "machine": machine(), "clock": CLOCK,
            "equal_time_s": equal_time_s,
            "target_accuracy": median_of([r for rs in kept.values() for r in rs], "target_accuracy"),
            "results": results, "speedup_vs_sync": speedups(paired, {n: aggregate(v) for n, v in paired.items()}),
            "not_emulating": [[n, r["seed"]] for n, v in runs.items() for r in v if not r.get("emulating", True)],
            "other_start": unlike,
            "runs": runs}


def record(path: Path, workload: dict, preset: str, run: dict, command: str) -> dict[str, list[dict]]:
    """Adds one run to the results file as the file is now, under a lock on its folder (another process filling
    other seeds of the same matrix may have written since this one began); the file's runs after it."""
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        runs.setdefault(preset, []).append(run)
        write_report(str(path), report_of(workload, runs, command))
        return runs
    finally:
        os.close(lock)  # closing releases the lock


def started_run(cfg: Config, tries: int = 5) -> list[dict]:
    """run_loaded, tried again where Ray did not start: on a loaded machine its node can miss Ray's fixed 30 s."""
    for attempt in range(tries):
        try:
            return run_loaded(cfg)
        except Exception as e:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(e) or attempt == tries - 1:
                raise
            print(f"[budget] Ray did not start ({e}); trying again", flush=True)
            time.sleep(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--budgets", default="2,4")
    p.add_argument("--presets", default=",".join(COLOCATED + list(SPLIT)))
    p.add_argument("--seeds", type=int, default=5, help="seeds first-seed .. seeds-1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/emulated_budget")
    args = p.parse_args()
    command = "python benchmarks/emulated_budget.py " + " ".join(sys.argv[1:])
    for name in args.workloads.split(","):
        config, short = WORKLOADS[name]
        for gpus in map(int, args.budgets.split(",")):
            path = RESULTS / f"emulated_budget_{name}_{gpus}gpu.json"
            workload = {"config": config, "overrides": short, "target": TARGET, "gpus": gpus,
                        "layouts": {preset: layout(preset, gpus) for preset in args.presets.split(",")}}
            runs = json.loads(path.read_text())["runs"] if path.exists() else {}
            why = started_elsewhere([first_run(runs)] if runs else [], load_config(config, short))
            if why:
                print(f"[budget] {path}: {why}. Measure the file again whole here (move it aside first), or add to "
                      "it on the machine that measured it.", file=sys.stderr, flush=True)
                return 2
            # seeds outermost: every preset's first seeds before anyone's fifth
            for seed in range(args.first_seed, args.seeds):
                for preset in args.presets.split(","):
                    if any(r["seed"] == seed and r.get("emulating", True) for r in runs.get(preset, [])):
                        continue
                    overrides = short + layout(preset, gpus) + [f"seed={seed}"]
                    started = time.time()
                    run_dir = Path(args.out_dir) / f"{name}-{gpus}gpu" / f"{preset}-s{seed}"
                    run_cfg = run_config(config, overrides, run_dir)
                    summary = summarise_run(started_run(run_cfg), Target.parse(TARGET), budget_gpus(run_cfg))
                    runs = record(path, workload, preset,
                                  {**summary, "seed": seed, "wall_clock_s": time.time() - started}, command)
                    first = first_run(runs)
                    if not same_start(summary, first):
                        print(f"[budget] {path.name}: {preset} seed {seed} started from another model than the "
                              f"file's first run (step-0 accuracy {summary['initial_accuracy']} against "
                              f"{first['initial_accuracy']}): kept under other_start, left out of the "
                              "figures; measure the file again whole on one machine", file=sys.stderr, flush=True)
                    print(f"[budget] {name} {gpus} GPUs {preset} seed {seed}: {time.time() - started:.0f} s, "
                          f"final accuracy {summary['final_accuracy']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
