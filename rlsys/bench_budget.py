"""`rlsys bench --budgets / --workloads / --instrument`: every preset on one GPU budget (issue 45), the emulated
comparison rerun at an equal budget of modelled GPUs.

Each budget B runs every preset on B modelled H100s (emulate.gpus=B). Colocated (one engine per GPU, the trainer
on all of them, contending with the engines where they overlap): sync, tail, tail-streamed, sorted,
sorted-partial, sagc, async, async-eta2. Split (B/2 engine GPUs, the trainer on the other B/2): async-split and
async-eta2-split. Per (workload, budget) one results file, benchmarks/results/emulated_budget_<workload>_<B>gpu.json,
rewritten after every run in `rlsys bench`'s report format (GPU-seconds, ratios with paired t 95% intervals).
Resumable: a (preset, seed) already in the file is not run again, so the matrix grows over several sessions, and
several processes may fill one file side by side (each run is claimed before it starts and added to the file as it
is then, under a lock, so two processes given the same command share the matrix); one that did not emulate (its
real compute overran, e.g. on a loaded machine) is kept, left out of the figures, and run again. Every run must
start from the file's model, and another CPU warm-starts the tiny model to other weights
(benchmarks/warm_start_cpu_kernels.py): an --instrument file carries its start model beside it
(results/start_models/<file's stem>, copied from the first machine's build), so any machine adds to it. Elsewhere
a machine that builds another model than the file's runs logged is refused before it runs; a run from before
fingerprints whose step-0 accuracy differs from the file's first run's is kept under `other_start`, left out.

    nice -n 5 rlsys bench --workloads old --budgets 2 --presets sync,tail --seeds 3
    nice -n 5 rlsys bench --workloads longcot --budgets 2 --presets sync,tail --seeds 2
    rlsys bench --budgets 2,4                      # the whole matrix, 5 seeds, skipping what is done
    rlsys bench --budgets 2,4 --seeds 5 --first-seed 3   # seeds 3 and 4 only, beside another process

--instrument: the long runs that judge every schedule by the accuracy it reaches per GPU-second. Each run trains
--steps (40) steps with an eval every 2 on --eval-size prompts (by default the size whose standard error is a third
of the smallest target's gap, from the stored sync runs), against targets set from sync's own curve
(rlsys.bench.sync_targets); --seeds (3) per preset, 8 for sync and the two best (--preset-seeds). Its files are new:
benchmarks/results/emulated_budget2_<workload>_<B>gpu.json. A plan of the CPU-hours is printed before any run.

    nice -n 5 rlsys bench --instrument --workloads longcot,reason --budgets 2  # run twice
"""
from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from rlsys.bench import (INTERVALS, PRESETS, TARGETS_HOW, Target, add_equal_time, add_targets, aggregate,
                         budget_gpus, machine, median_of, run_config, run_loaded, same_start, speedups,
                         started_elsewhere, summarise_run, sync_targets, write_report)
from rlsys.config import Config, ConfigError
from rlsys.errors import UserError, flags
from rlsys.models import made_once, prepare_model, weights_fingerprint
from rlsys.startup import load_config

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"  # the repository's; not installed
# name -> config; every run as long as the stored emulated table's (its overrides and target); time to target is
# interpolated between evals
# (old: the default task mix; longcot: cot_sum, whose answers lengthen as the policy learns, long-CoT RL's shape)
SHORT = ["trainer.total_steps=20", "control.eval_every=5", "data.eval_size=1000", "control.save_every=0"]
# longcot's steps grow as its answers do: 10 steps and evals of 500 fit two seeds of two presets in half an hour
LONGCOT_SHORT = ["trainer.total_steps=10", "control.eval_every=5", "data.eval_size=500", "control.save_every=0"]
# longcot32: longcot as first run, before its engines got the slots their modelled KV holds
WORKLOADS = {"old": ("configs/emulated_h100_7b.yaml", SHORT),
             "longcot": ("configs/emulated_h100_7b_cot.yaml", LONGCOT_SHORT),
             "longcot32": ("configs/emulated_h100_7b_cot.yaml", LONGCOT_SHORT + ["rollout.slots=32"]),
             # reason: a reasoning model's shape (right-skewed lengths that grow with difficulty and with training)
             "reason": ("configs/emulated_h100_7b_reason.yaml", LONGCOT_SHORT)}
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


# The instrument (--instrument): runs long enough for sync's curve to flatten, an eval every EVAL_EVERY steps
EVAL_EVERY = 2
SEEDS = 3
# sync and the two presets nearest sync's 75% target in GPU-seconds in the first seed of every preset on `reason`
# at two GPUs (emulated_budget2_reason_2gpu.json: sorted-partial 1.35x, tail 1.18x; async-eta2, first chosen from
# the long-CoT files, is refused there: it generates while it trains): 8 seeds, for intervals narrow enough to rank
PRESET_SEEDS = "sync=8,sorted-partial=8,tail=8"
EVAL_SIZES = (1000, 2000)  # the eval's bounds: evals are not paced (the emulated clock stops) but cost CPU time
# wall seconds per eval prompt: 200 cot_sum prompts took 2.8-3.4 s (timing/eval_s) on this 2-core machine under a
# load of 12, so a long run's 21 evals of ~1800 prompts cost about as much as its 40 steps (and less when it is idle)
EVAL_S_PER_PROMPT = 0.015


def instrument_overrides(steps: int, eval_size: int) -> list[str]:
    return [f"trainer.total_steps={steps}", f"control.eval_every={EVAL_EVERY}", f"data.eval_size={eval_size}",
            "control.save_every=0"]


def stored_file(name: str, gpus: int) -> Path | None:
    """The stored (pre-instrument) budget file of a workload: at this budget, else at any."""
    paths = [RESULTS / f"emulated_budget_{name}_{gpus}gpu.json",
             *sorted(RESULTS.glob(f"emulated_budget_{name}_*gpu.json"))]
    return next((p for p in paths if p.exists()), None)


@functools.lru_cache
def stored_report(path: Path) -> dict:
    """A stored (pre-instrument) budget file, parsed once: the plan estimates every preset from it."""
    return json.loads(path.read_text())


def eval_size_for(name: str, gpus: int) -> tuple[int, str]:
    """An eval size whose standard error, sqrt(p(1-p)/n) at sync's final accuracy p, is at most a third of the
    smallest target's gap (25% of sync's gain: sync_targets), from the workload's stored sync runs, within
    EVAL_SIZES; and how it was set. The stored runs are shorter and gained less than a long run will: the size
    errs large."""
    path = stored_file(name, gpus)
    sync = stored_report(path)["runs"].get("sync") if path else None
    if not sync:
        return EVAL_SIZES[1], f"{name}: no stored sync run, the largest eval ({EVAL_SIZES[1]})"
    targets = sync_targets(sync)
    start = statistics.median(r["eval_curve"][0][1] for r in sync)
    p = statistics.median(r["eval_curve"][-1][1] for r in sync)
    if targets["gain_25"] is None:
        return EVAL_SIZES[1], f"{name}: sync gained nothing in {path.name}, the largest eval ({EVAL_SIZES[1]})"
    gap = targets["gain_25"] - start
    needed = math.ceil(9 * p * (1 - p) / gap ** 2)
    size = min(max(needed, EVAL_SIZES[0]), EVAL_SIZES[1])
    se = math.sqrt(p * (1 - p) / size)
    return size, (f"{name}: sync's gain in {path.name} {4 * gap:.3f}, the smallest target's gap {gap:.3f}; "
                  f"se <= gap/3 needs {needed} eval prompts at accuracy {p:.3f}; {size} give se {se:.4f} "
                  f"= gap/{gap / se:.1f}")


def seed_counts(presets: list[str], seeds: int, overrides: str) -> dict[str, int]:
    """Seeds per preset: `seeds`, or the count --preset-seeds gives it ("sync=8,tail=5")."""
    counts = dict.fromkeys(presets, seeds)
    for item in filter(None, overrides.split(",")):
        preset, _, count = item.partition("=")
        if not count.isdigit():
            raise UserError(f"--preset-seeds: {item!r} is not PRESET=COUNT")
        if preset in counts:
            counts[preset] = int(count)
    return counts


def setting(overrides: list[str], key: str) -> int:
    """A whole-number setting among overrides ("trainer.total_steps=40": 40)."""
    return int(next(o for o in overrides if o.startswith(key + "=")).split("=", 1)[1])


def eval_s(overrides: list[str]) -> float:
    """A run's wall seconds in evals (EVAL_S_PER_PROMPT): one before training, one every eval_every steps after."""
    evals = setting(overrides, "trainer.total_steps") // setting(overrides, "control.eval_every") + 1
    return evals * setting(overrides, "data.eval_size") * EVAL_S_PER_PROMPT


def estimated_s(name: str, gpus: int, preset: str, overrides: list[str]) -> tuple[float, str]:
    """A run's wall seconds, and the file they are estimated from: its preset's median stored run (wall_clock_s; of
    all presets where it has none) less its evals, scaled per step (a long-CoT run's later steps are longer: this
    errs short), plus its own evals."""
    path = stored_file(name, gpus) or stored_file("longcot", gpus)
    if not path:
        return 0.0, "no stored run"
    stored = stored_report(path)
    done = stored["workload"]["overrides"]
    runs = stored["runs"].get(preset) or [r for v in stored["runs"].values() for r in v]
    per_step = statistics.median((r["wall_clock_s"] - eval_s(done)) / setting(done, "trainer.total_steps")
                                 for r in runs)
    return per_step * setting(overrides, "trainer.total_steps") + eval_s(overrides), path.name


def claimed(path: Path, preset: str, seed: int) -> bool:
    """Claims (preset, seed) for this process, under the folder's lock (record's): False if the file holds an
    emulating run of it or another live process claimed it. A claim lives in <file>.claims until record drops it;
    a dead process's claim is taken over."""
    with locked(path.parent):
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        if any(r["seed"] == seed and r.get("emulating", True) for r in runs.get(preset, [])):
            return False
        claims = read_claims(path)
        pid = claims.get(f"{preset}/{seed}")
        if pid and pid != os.getpid() and alive(pid):
            return False
        write_claims(path, {**claims, f"{preset}/{seed}": os.getpid()})
        return True


def claims_path(path: Path) -> Path:
    return path.with_name(path.name + ".claims")


def read_claims(path: Path) -> dict[str, int]:
    return json.loads(claims_path(path).read_text()) if claims_path(path).exists() else {}


def write_claims(path: Path, claims: dict[str, int]) -> None:
    if claims:
        claims_path(path).write_text(json.dumps(claims) + "\n")
    else:
        claims_path(path).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class locked:
    """An exclusive lock on a folder while the block runs: processes filling one file take turns."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        self.fd = os.open(self.folder, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)  # closing releases the lock


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
    targets = add_targets(kept)  # so does this, its GPU-seconds and samples to sync's targets
    results = {n: aggregate(v) for n, v in kept.items()}
    return {"command": command, "workload": workload, "machine": machine(), "clock": CLOCK,
            "equal_time_s": equal_time_s,
            "target_accuracy": median_of([r for rs in kept.values() for r in rs], "target_accuracy"),
            "targets": targets, "targets_how": TARGETS_HOW, "intervals": INTERVALS,
            "results": results,
            "speedup_vs_sync": speedups(paired, {n: aggregate(v) for n, v in paired.items()}, targets),
            "not_emulating": [[n, r["seed"]] for n, v in runs.items() for r in v if not r.get("emulating", True)],
            "other_start": unlike,
            "runs": runs}


def record(path: Path, workload: dict, preset: str, run: dict, command: str) -> dict[str, list[dict]]:
    """Adds one run to the results file as the file is now, under a lock on its folder (another process filling
    other seeds of the same matrix may have written since this one began); the file's runs after it."""
    with locked(path.parent):
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        runs.setdefault(preset, []).append(run)
        write_report(str(path), report_of(workload, runs, command))
        claims = read_claims(path)
        claims.pop(f"{preset}/{run['seed']}", None)
        write_claims(path, claims)
        return runs


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


def start_model(path: Path, config: str, short: list[str]) -> Path:
    """The model every run of the results file `path` starts from, kept beside it: start_models/<its stem>, a copy
    of this machine's build when the file has none. Named only by a fingerprint, a file could grow on one machine
    alone (the warm start's floating-point results differ between CPU models); carried, it grows on any."""
    kept = path.parent / "start_models" / path.stem
    if kept.is_dir():
        return kept
    built = prepare_model(load_config(config, short))
    return made_once(kept, lambda tmp: shutil.copytree(built, tmp, dirs_exist_ok=True))


def other_start_model(runs: dict[str, list[dict]], start: Path) -> str | None:
    """Why runs from `start` may not join `runs` (None if they may): the file's runs logged another model."""
    logged = (first_run(runs) or {}).get("model_fingerprint")
    here = weights_fingerprint(start)
    if logged and logged != here:
        return f"its runs started from the model {logged}, and its start model {start} is {here}"
    return None


def refused(config: str, short: list[str], presets: list[str], gpus: int) -> dict[str, str]:
    """The presets whose layout on `gpus` modelled GPUs the config refuses, with why: a trainer whose states do not
    fit the GPUs it is given (rlsys/emulate.py check_trainer_fits: a 7B model's Adam states on the one GPU of a
    2-GPU split or scale-down) is no run to compare, and is named in the report instead."""
    out = {}
    for preset in presets:
        try:
            load_config(config, short + layout(preset, gpus))
        except ConfigError as e:
            out[preset] = str(e).split("\n", 1)[-1].strip()
            print(f"[budget] {preset} on {gpus} GPUs refused: {out[preset]}", flush=True)
    return out


def print_plan(matrix: list[tuple], presets: list[str], counts: dict[str, int], first_seed: int,
               refusals: dict[tuple, dict[str, str]]) -> None:
    """The runs still to do and their CPU-hours (estimated_s), before any starts; refused presets run nothing."""
    total, n = 0.0, 0
    for name, gpus, path, short in matrix:
        kept = [p for p in presets if p not in refusals[name, gpus]]
        done = json.loads(path.read_text())["runs"] if path.exists() else {}
        todo = {p: [s for s in range(first_seed, counts[p]) if not any(
            r["seed"] == s and r.get("emulating", True) for r in done.get(p, []))] for p in kept}
        estimates = {p: estimated_s(name, gpus, p, short) for p in kept}
        seconds = {p: e[0] for p, e in estimates.items()}
        hours = sum(len(s) * seconds[p] for p, s in todo.items()) / 3600
        evals = sum(map(len, todo.values())) * eval_s(short) / 3600
        total, n = total + hours, n + sum(map(len, todo.values()))
        print(f"[budget] plan {path.name}: " + ", ".join(f"{p} {len(s)} x {seconds[p] / 60:.0f} min"
                                                         for p, s in todo.items() if s) + f": {hours:.1f} CPU-hours, "
              f"{evals:.1f} of them in evals (from {', '.join(sorted({e[1] for e in estimates.values()}))})", flush=True)
    print(f"[budget] plan: {n} runs, {total:.1f} hours of one process (about {total / 2:.1f} h with two side by side, "
          "where the machine keeps both emulating: a run that overran is named in not_emulating)", flush=True)


# `rlsys bench`'s options: those that choose the budget matrix, its own, and the single workload's it refuses
CHOOSING = {"workloads", "budgets", "instrument"}
OWN = CHOOSING | {"seeds", "first_seed", "steps", "eval_size", "preset_seeds", "results_dir", "plan_only"}
BENCH_ONLY = {"items", "repeats", "target", "vary_seed", "quick", "output", "top_up"}


def add_arguments(p) -> None:
    g = p.add_argument_group("every preset on budgets of modelled GPUs", "chosen by --budgets, --workloads or "
                             "--instrument; there --presets defaults to every colocated and split preset and "
                             "--out-dir to runs/emulated_budget")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)} (default: all)")
    g.add_argument("--budgets", default="2,4", help="modelled H100s, one results file each (default 2,4)")
    g.add_argument("--seeds", type=int, help=f"seeds first-seed .. seeds-1 (default 5; --instrument: {SEEDS})")
    g.add_argument("--first-seed", type=int, default=0)
    g.add_argument("--instrument", action="store_true", help="the long runs against sync's own targets: new files "
                   "emulated_budget2_<workload>_<B>gpu.json")
    g.add_argument("--steps", type=int, default=40, help="--instrument: steps per run (default 40)")
    g.add_argument("--eval-size", type=int, help="--instrument: eval prompts (default: eval_size_for's)")
    g.add_argument("--preset-seeds", default=PRESET_SEEDS,
                   help=f"--instrument: seeds of the presets that run more than --seeds (default {PRESET_SEEDS})")
    g.add_argument("--results-dir", default=str(RESULTS), help="where the results files are (default: the stored)")
    g.add_argument("--plan-only", action="store_true", help="print the plan and run nothing")


def run_from_args(args, given: set[str]) -> int:
    """The matrix, `given` the options the command line set; `args.argv` its words, recorded as its command."""
    if given & BENCH_ONLY:
        raise UserError(f"{flags(given & BENCH_ONLY)}: not with {flags(given & CHOOSING)}, which runs every preset "
                        "on the workloads' own configs")
    command = "rlsys " + " ".join(args.argv)
    presets = (args.presets if "presets" in given else ",".join(COLOCATED + list(SPLIT))).split(",")
    out_dir = Path(args.out_dir if "out_dir" in given else "runs/emulated_budget")
    seeds = args.seeds or (SEEDS if args.instrument else 5)
    counts = seed_counts(presets, seeds, args.preset_seeds if args.instrument else "")
    matrix = []  # (workload, budget, its file, its overrides)
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            raise UserError(f"--workloads: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        config, short = WORKLOADS[name]
        for gpus in map(int, args.budgets.split(",")):
            if args.instrument:
                size, how = (args.eval_size, f"{name}: --eval-size {args.eval_size}") if args.eval_size else \
                    eval_size_for(name, gpus)
                print(f"[budget] eval size {how}", flush=True)
                short = instrument_overrides(args.steps, size)
            prefix = "emulated_budget2" if args.instrument else "emulated_budget"
            matrix.append((name, gpus, Path(args.results_dir) / f"{prefix}_{name}_{gpus}gpu.json", short))
    refusals = {(name, gpus): refused(WORKLOADS[name][0], short, presets, gpus) for name, gpus, _, short in matrix}
    print_plan(matrix, presets, counts, args.first_seed, refusals)
    if args.plan_only:
        return 0
    for name, gpus, path, short in matrix:
        config = WORKLOADS[name][0]
        kept = [p for p in presets if p not in refusals[name, gpus]]
        workload = {"config": config, "overrides": short, "target": TARGET, "gpus": gpus,
                    "layouts": {preset: layout(preset, gpus) for preset in kept},
                    "refused": refusals[name, gpus]}
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        start = start_model(path, config, short) if args.instrument else None
        why = (other_start_model(runs, start) if start else
               started_elsewhere([first_run(runs)] if runs else [], load_config(config, short)))
        if why:
            print(f"[budget] {path}: {why}. Measure the file again whole here (move it aside first), or add to "
                  "it on the machine that measured it.", file=sys.stderr, flush=True)
            return 2
        # seeds outermost: every preset's first seeds before anyone's fifth
        for seed in range(args.first_seed, max(counts.values())):
            for preset in (p for p in kept if seed < counts[p]):
                if not claimed(path, preset, seed):  # done, or another process runs it
                    continue
                overrides = short + layout(preset, gpus) + [f"seed={seed}"] + ([f"model.path={start}"] if start else [])
                started = time.time()
                run_dir = out_dir / f"{path.stem}" / f"{preset}-s{seed}"
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
