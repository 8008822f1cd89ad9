"""The simulator against the published figures (docs/performance.md "Calibration sources"), in sample and each
paper predicted from the others; then the 128-GPU headline as a range, run on the model the held-out rows test.

    rlsys simulate --calibrate --output benchmarks/results/sim_calibration.json \
        --sweep-output benchmarks/results/sim_128_sweep.json
    rlsys simulate --calibrate --quick        # one step a run and a small sweep: the JSON's shape, not its figures

About 420 CPU seconds, its parts a process a core: under 10 minutes of wall time on an idle 2-core machine (the
JSON's `wall_s` and `cpu_s` give the run's own).

Its parts: what the rows are held to (rlsys/sim/calibration_sources.py), the configs as run
(calibration_configs.py), the rows (calibration_tp.py, calibration_rows.py) and the sweep (calibration_sweep.py);
this module runs them side by side and counts the hits.

Every calibrated config shares one set of physical constants (CONSTANTS: the engine's step overhead and the
trainer's MFU law, each from a published measurement that is none of the rows), and RollPacker's settings take
their median response length from another paper (CITED_MEDIAN). In sample, per RollPacker setting the engine's step
overhead is fitted to its veRL rollout (fit_overhead), and the TP efficiency and the long-round TP cap to
RollPacker's TP rows. Held out (HELD_OUT, the held-out model), nothing is set from any RollPacker row: the shared
step overhead, an ideal TP split, long rounds at the cost model's TP. Held out one setting at a time, a setting's
step overhead is the geometric mean of the other two settings' fits (leave_one_out). A row touched by a choice made
while matching it (the MFU law's shape, against RollPacker's scaling rows) is named and not counted held out. Rows
are counted one by one and per experiment (EXPERIMENTS: rows of one experiment share its errors). A row is within
when it lands within +-15%.
RollPacker's rows measure its own tail batching, whose response-level rule keeps each prompt's first R of
ceil(1.25 R) samples (the slowest aborted): every RollPacker tail run here runs that rule (ROLLPACKER_ETA_R,
rlsys/sim/first_r.py), the algorithm the rows measured. rlsys's tail trains whole groups (unbiased); held out, its
stack runs beside (rows_whole_groups), and the ratio of the two is the part of RollPacker's speed-up owed to its
biased selection (selection_share).
Then the 128-GPU sweep: RollPacker's 32B/32k setting on 128 H800 (the batch and every reward pool grown with the
GPUs) on the held-out model (validated above), at the shared step overhead and at the one held out against the
32B setting, over the runaway share, the trainer's MFU band (both ways), the length spread and seeds, 20 steps a
run; each schedule against veRL-style sync. The headline is the best schedule with a published anchor (ANCHORED)
at equal utility, rlsys's unbiased tail; the others are reported as unvalidated, and RollPacker's rule beside it as
biased (BIASED).
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rlsys.bench import machine
from rlsys.errors import UserError
from rlsys.sim.calibration_configs import fit_overhead, leave_one_out
from rlsys.sim.calibration_rows import async_rows, rollpacker_rows, scaling_rows, selection_share
from rlsys.sim.calibration_sources import (ANCHORED, BIASED, CITED_MEDIAN, CONSTANTS, EXPERIMENTS, HELD_OUT, LENGTHS,
                                           MFU_128, NAMED_IN_SAMPLE, OVERHEAD_128, POINTS, QUICK, ROLLPACKER, SEEDS,
                                           SWEEP_CONFIG, SWEEP_GPUS, SWEEP_PROMPTS, SWEEP_SCHEDULES, SWEEP_STEPS,
                                           TP_GRID)
from rlsys.sim.calibration_sweep import point_key, rollpacker_mfu, summarise, sweep_point
from rlsys.sim.calibration_tp import tp_fit, tp_rows, tp_rows_held_out


# --- counting the rows --------------------------------------------------------------------------------------
def counted(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["fitted"] and "same_as" not in r and "in_sample_by" not in r]


def named_in_sample(rows: list[dict]) -> list[dict]:
    """Held-out rows, those a choice was made against named (NAMED_IN_SAMPLE): shown, not counted."""
    out = []
    for r in rows:
        why = next((w for key, w in NAMED_IN_SAMPLE.items() if r["name"].startswith(key)), None)
        out.append({**r, "in_sample_by": why} if why and "same_as" not in r else r)
    return out


def hit_rate(rows: list[dict]) -> dict:
    """The counted rows (neither fitted, nor equal to another by construction, nor named in sample) within 15%: in
    all, per paper and per experiment; an experiment hits when every one of its counted rows does, and
    `experiment_share` weighs each experiment's share of rows within alike."""
    ahead = counted(rows)
    group = lambda key: {k: {"rows": sum(r[key] == k for r in ahead),  # noqa: E731
                             "within": sum(r["within"] for r in ahead if r[key] == k)}
                         for k in dict.fromkeys(r[key] for r in ahead)}
    experiments = group("experiment")
    return {"rows": len(ahead), "within": sum(r["within"] for r in ahead), "by_paper": group("paper"),
            "by_experiment": experiments, "experiments": len(experiments),
            "experiments_within": sum(e["within"] == e["rows"] for e in experiments.values()),
            "experiment_share": round(sum(e["within"] / e["rows"] for e in experiments.values())
                                      / max(1, len(experiments)), 3)}


def cpu_seconds() -> float:
    """User and system seconds of this process and its finished workers (the pool's, once it is shut down)."""
    usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(r.ru_utime + r.ru_stime for r in usage)


# --- the whole calibration ----------------------------------------------------------------------------------
def calibrate(steps: int | None = None, with_sweep: bool = True, quick: bool = False) -> tuple[dict, dict | None]:
    """`steps` overrides every config's step count; `quick` runs one step each and a small sweep. The parts run
    side by side, a process a core, the longest first: each simulation is seeded, so the figures do not depend on
    the order."""
    start, cpu_start, host = time.perf_counter(), cpu_seconds(), machine()
    steps = 1 if quick else steps
    sweep_steps = steps or SWEEP_STEPS
    grid = QUICK if quick else {"points": POINTS, "seeds": SEEDS, "schedules": list(SWEEP_SCHEDULES)}
    needs = lambda point: {MFU_128[point[1]], point[2]} & {"implied", "held out for 32B"}  # noqa: E731
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        overheads = {c: pool.submit(fit_overhead, c, steps, 2 if quick else 8) for c in ROLLPACKER}
        fit = pool.submit(tp_fit, 5, TP_GRID[::5]) if quick else pool.submit(tp_fit, steps)  # a long round every 5th
        implied = pool.submit(rollpacker_mfu, steps)
        out_parts = [pool.submit(rollpacker_rows, steps, None, True), pool.submit(scaling_rows, steps, None, True),
                     pool.submit(tp_rows_held_out, 5 if quick else steps)]
        whole = pool.submit(rollpacker_rows, steps, None, True, False)  # rlsys's tail on the held-out model
        verl = pool.submit(async_rows, steps)
        submit = lambda point, seed, values: pool.submit(  # noqa: E731
            sweep_point, point, seed, sweep_steps, grid["schedules"], values)
        sweep = {(p, s): submit(p, s, {}) for p in grid["points"] if not needs(p) for s in grid["seeds"]} \
            if with_sweep else {}
        fitted = {c: job.result() for c, job in overheads.items()}
        chosen = {c: f["step_overhead_ms"] for c, f in fitted.items()}
        held_one = leave_one_out(chosen)
        values = {"implied": implied.result()["mfu_128"], "held out for 32B": held_one[SWEEP_CONFIG]}
        sweep.update({(p, s): submit(p, s, values) for p in grid["points"] if needs(p) for s in grid["seeds"]}
                     if with_sweep else {})
        one_out = pool.submit(rollpacker_rows, steps, held_one, True)
        in_parts = [pool.submit(rollpacker_rows, steps, chosen), pool.submit(scaling_rows, steps, chosen)]
        report = {"machine": host, "constants": CONSTANTS, "held_out": HELD_OUT, "step_overheads": fitted,
                  "step_overheads_one_out": held_one, "tp_fit": fit.result()}
        others = verl.result()
        report["rows"] = tp_rows(report["tp_fit"]) + [r for part in in_parts for r in part.result()] + others
        # out of sample: RollPacker's and SortedRL's rows from the held-out model's runs; veRL's page sets nothing
        held = [r for part in out_parts for r in part.result()] + others
        report["rows_out_of_sample"] = named_in_sample(held)
        report["rows_whole_groups"] = whole.result()
        report["selection_share"] = selection_share(out_parts[0].result(), report["rows_whole_groups"])
        # one setting at a time: its stack rows at the others' step overheads, the rest as held out
        rest = {EXPERIMENTS[k] for k in ("scaling", "qwen3-8b", "veRL fully-async")}
        report["rows_one_out"] = named_in_sample(one_out.result() + [r for r in held if r["experiment"] in rest])
        report["hit_rate"] = {key: hit_rate(report[rows]) for key, rows in ROW_SETS.items()}
        points = [sweep[(p, s)].result() for p in grid["points"] for s in grid["seeds"]] if with_sweep else []
        report["rollpacker_mfu"] = implied.result()
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["cpu_s"] = round(cpu_seconds() - cpu_start, 1)  # all cores' time: grows less with the load than the wall
    found = None
    if points:
        found = {"machine": report["machine"], "config": SWEEP_CONFIG, "gpus": SWEEP_GPUS, "model": HELD_OUT,
                 "prompts_per_step": SWEEP_PROMPTS, "steps": sweep_steps, "seeds": list(grid["seeds"]),
                 "mfu_128": {**MFU_128, "rollpacker table 1": values["implied"]},
                 "rollpacker_mfu": report["rollpacker_mfu"],
                 "lengths": {k: {"median_tokens": CITED_MEDIAN, "sigma": 1.0, **v} for k, v in LENGTHS.items()},
                 "step_overhead_128_ms": {k: v or values[k] for k, v in OVERHEAD_128.items()},
                 "anchored": ANCHORED, "biased": {k: "RollPacker's rule: each prompt's first R of ceil(1.25 R) samples"
                                                  for k in BIASED}, "summary": summarise(points), "points": points,
                 "wall_s": report["wall_s"], "cpu_s": report["cpu_s"]}
    return report, found


ROW_SETS = {"in_sample": "rows", "out_of_sample": "rows_out_of_sample", "one_setting_out": "rows_one_out",
            "whole_groups": "rows_whole_groups"}


def print_report(report: dict, found: dict | None) -> None:
    fit = report["tp_fit"]
    print(f"tp_efficiency fitted {fit['tp_efficiency']} (rlsys/costs.py: {fit['in_costs']}); step overheads "
          f"fitted at the cited median ({CITED_MEDIAN} tokens) "
          + ", ".join(f"{c} {m['step_overhead_ms']} ms" for c, m in report["step_overheads"].items())
          + "; one setting out " + ", ".join(f"{c} {ms} ms" for c, ms in report["step_overheads_one_out"].items()))
    for key, rows in ROW_SETS.items():
        hits, rows = report["hit_rate"][key], report[rows]
        print(f"\n{key}: {hits['within']} of {hits['rows']} counted rows within 15%, "
              f"{hits['experiments_within']} of {hits['experiments']} experiments whole (mean share "
              f"{hits['experiment_share']:.2f}): "
              + ", ".join(f"{p} {h['within']}/{h['rows']}" for p, h in hits["by_experiment"].items()))
        print(f"{'row':<52} {'published':>9} {'simulated':>9} {'ratio':>6}")
        for r in rows:
            mark = ("fit" if r["fitted"] else "same" if "same_as" in r else "named" if "in_sample_by" in r
                    else "" if r["within"] else "MISS")
            print(f"{r['name']:<52} {r['published']:>9.2f} {r['simulated']:>9.2f} {r['ratio']:>6.2f} {mark}")
    print("\nheld out, RollPacker's rule over rlsys's whole groups (the part owed to selection): "
          + ", ".join(f"{name.removesuffix(' speedup')} {v['first_r']:.2f}x / {v['whole_groups']:.2f}x = "
                      f"{v['owed_to_selection']:.2f}" for name, v in report["selection_share"].items()))
    if found:
        s = found["summary"]
        owed = s["owed_to_selection"] or {"min": math.nan, "max": math.nan, "mean": math.nan}
        print(f"\n128 H800: RollPacker's rule over tail/G4 {owed['min']:.2f}-{owed['max']:.2f} (mean {owed['mean']:.2f})")
        low, high = s["best_speedup_range"] or (math.nan, math.nan)
        print(f"\n128 H800, {found['config']}: best anchored {low:.2f}x to {high:.2f}x sync "
              f"({', '.join(s['best_schedules'])}; {s['unranked']} runs without one at equal utility)")
        for p in found["points"]:
            other = p["best_unvalidated"]
            best = p["best"] or {"schedule": "none at equal utility", "speedup_vs_sync": math.nan}
            print(f"{point_key(p)} seed {p['seed']} (mfu {p['trainer_mfu_128']:.2f}, {p['step_overhead_ms']} ms): "
                  f"best {best['schedule']} {best['speedup_vs_sync']:.2f}x"
                  + (f", unvalidated {other['schedule']} {other['speedup_vs_sync']:.2f}x" if other else ""))
    print(f"\n{report['wall_s']} s ({report['cpu_s']} CPU s)")


# --- `rlsys simulate --calibrate` ---------------------------------------------------------------------------
OWN = {"quick", "sweep_output", "no_sweep", "steps"}  # options of the calibration alone (--output is shared)


def add_arguments(parser) -> None:
    g = parser.add_argument_group("the simulator against the published papers", "chosen by --calibrate, which runs "
                                  "the calibrated configs of configs/sim/ (no CONFIG)")
    g.add_argument("--calibrate", action="store_true", help="in-sample fits, held-out rows, one setting out, the TP "
                   "fit and the 128-GPU sweep (about 420 CPU seconds); --output writes the rows as JSON")
    g.add_argument("--sweep-output", help="write the 128-GPU sweep as JSON")
    g.add_argument("--no-sweep", action="store_true", help="the calibration rows only")
    g.add_argument("--steps", type=int, help="steps per run everywhere, instead of each config's")
    g.add_argument("--quick", action="store_true",
                   help="one step per run and a small sweep: checks the JSON's shape, not the figures")


def run_from_args(args, given: set[str]) -> int:
    """The calibration, `given` the options the command line set (a config is refused: it runs its own)."""
    if "config" in given:
        raise UserError(f"a config ({args.config}): not with --calibrate, which runs the calibrated configs of "
                        "configs/sim/")
    report, found = calibrate(args.steps, not args.no_sweep, args.quick)
    print_report(report, found)
    for path, data in ((args.output, report), (args.sweep_output, found)):
        if path and data:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(data, indent=2) + "\n")
    return 0
