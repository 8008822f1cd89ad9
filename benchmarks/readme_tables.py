"""The result tables of README.md and docs/, rendered from benchmarks/results/.

Each table sits in a document between `<!-- table: NAME -->` and `<!-- /table -->`; TABLES[NAME] renders it
from its results file. tests/test_readme.py fails when a document's table differs from its rendering, so a
figure cannot drift from the file it comes from. Figures quoted in prose are listed in `prose_figures`.

    python benchmarks/readme_tables.py           # exit 1 and name the stale tables
    python benchmarks/readme_tables.py --write   # rewrite them in place
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from functools import partial
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rlsys, when run as a script from anywhere
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in ("performance", "emulation", "schedulers", "tools"))]
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
TABLES: dict[str, Callable[[], str]] = {}


def table(name: str):
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        TABLES[name] = fn
        return fn
    return register


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def rows(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spread(r: dict, key: str, digits: int = 3) -> str:
    """A median with its [min, max] over repeats."""
    lo_hi = r.get(f"{key}_spread")
    text = num(r[key], digits)
    return f"{text} [{num(lo_hi[0], digits)}, {num(lo_hi[1], digits)}]" if lo_hi else text


# --- live CPU runs (`rlsys bench`, `make train`) ------------------------------------------------------
@table("default_run")
def default_run() -> str:
    j = load("default_run_cpu")
    first, last = j["evals"][0], j["evals"][-1]
    acc = lambda e: f"{e['eval/accuracy']:.3f} ± {e['eval/accuracy_se']:.3f}"  # noqa: E731
    return rows(["", "step 0", f"step {last['step']}"], [
        ["eval/accuracy ± standard error (avg@1, 2,000 held-out prompts)", acc(first), acc(last)],
        ["training reward, mean of 10 steps", num(j["reward_first_10_steps"], 3), num(j["reward_last_10_steps"], 3)],
        ["training clock, s (eval and checkpoints excluded)", "0", num(j["training_clock_s"], 0)],
        ["evaluation, s, share of the run", f"{len(j['evals'])} evals", f"{j['eval_s']:.0f} ({100 * j['eval_share_of_run']:.0f}%)"],
        ["whole command, s", "", num(j["whole_command_s"], 0)]])


def diff_cell(d: dict, beyond: str = "") -> str:
    """An accuracy difference ± its error, `beyond` appended where it exceeds two of them."""
    return f"{d['diff']:+.3f} ± {d['se']:.3f}" + (beyond if d["beyond_error"] else "")


def ratio_cell(x: float, lo_hi) -> str:
    """A ratio with its [low, high]: a spread over pairs or an interval."""
    return f"{x:.2f}x [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]"


def acc_se(r: dict) -> str:
    """A final accuracy with its eval standard error."""
    return f"{r['final_accuracy']:.3f} ± {r['final_accuracy_se']:.3f}"


def versus_sync(j: dict, preset: str) -> str:
    """The preset's final accuracy minus sync's, ± the difference's error; starred beyond two of them."""
    d = j["speedup_vs_sync"][preset]["final_accuracy_vs_sync"]
    return "" if preset == "sync" else diff_cell(d, " *")


def speedup_cell(speedup: dict) -> str:
    """The median of the interleaved pairs' ratios with their [min, max]."""
    return ratio_cell(speedup["per_sample"], speedup["per_sample_spread"])


def bench_rows(name: str, presets: list[str] | None = None) -> list[list]:
    j = load(name)
    return [[f"`{preset}`", num(r["group_size"], 1), num(r["step_time_s"]), num(1000 * r["time_per_sample_s"]),
             spread(r, "bubble_ratio"), spread(r, "straggler_rate"), acc_se(r), versus_sync(j, preset),
             spread(r, "accuracy_at_equal_time"), speedup_cell(j["speedup_vs_sync"][preset])]
            for preset, r in j["results"].items() if not presets or preset in presets]


BENCH_HEADER = ["preset", "mean G", "step s", "ms / sample", "bubble", "straggler", "final avg@1",
                "final vs sync", "avg@1 at equal time", "speed per sample vs sync (pairs)"]


table("schedulers")(lambda: rows(BENCH_HEADER, bench_rows("bench_schedulers_cpu")))
table("schedulers_summary")(lambda: rows(BENCH_HEADER, bench_rows("bench_schedulers_cpu",
                                                                 ["sync", "sorted", "tail", "sagc"])))


@table("scheduler_figures")
def scheduler_figures() -> str:
    """The README's schedulers, each with the one figure the CPU runs measured of it (none per sample)."""
    s, overlap = load("bench_schedulers_cpu")["results"], load("bench_async_cpu")["speedup_vs_sync"]["async-loglinear"]
    bubble = lambda p: f"bubble {s[p]['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's"  # noqa: E731
    return rows(["scheduler", "what it does", "measured (CPU, live)"], [
        ["`sync` (default)", "generates B x G samples, trains when all are done",
         f"final avg@1 {acc_se(s['sync'])}, bubble {s['sync']['bubble_ratio']:.2f}"],
        ["`tail` (RollPacker)", "short rounds; prompts still running go to long rounds", bubble("tail")],
        ["`sorted` (SortedRL)", "oversubscribes the engines, trains groups as they finish", bubble("sorted")],
        ["`async` (AReaL)", "generates while the trainer trains, at most eta versions stale",
         f"{overlap['time_to_target']:.2f}x sooner to target (200 steps; rollout and trainer overlapped on two cores)"],
        ["`control.group_sizer=sagc`", "picks each step's group size under a straggler budget",
         f"mean G {s['sagc']['group_size']:.0f} (its budget never binds on this task)"]])


@table("presets")
def presets() -> str:
    from rlsys.bench import PRESETS

    return rows(["preset", "overrides on top of the workload"],
                [[f"`{name}`", " ".join(f"`{o}`" for o in overrides) or "none (the config as given)"]
                 for name, overrides in PRESETS.items()])


def times(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


@table("bench_async")
def bench_async() -> str:
    from rlsys.bench import pair_ratios

    j = load("bench_async_cpu")
    body = []
    for preset in (p for p in j["runs"] if p != "sync"):
        base, runs = j["runs"]["sync"], j["runs"][preset]
        per_sample, to_target = (pair_ratios(base, runs, key) for key in ("time_per_sample_s", "time_to_target_s"))
        for i, (s, a) in enumerate(zip(base, runs)):
            body.append([f"`{preset}`", f"repeat {i}",
                         f"{1000 * s['time_per_sample_s']:.2f} / {1000 * a['time_per_sample_s']:.2f}",
                         times(per_sample[i]), f"{num(s['time_to_target_s'], 0)} / {num(a['time_to_target_s'], 0)}",
                         times(to_target[i]), f"{acc_se(s)} / {acc_se(a)}"])
        speedup = j["speedup_vs_sync"][preset]
        body.append([f"`{preset}`", "median of the pairs; mean final", "", times(speedup["per_sample"]), "",
                     times(speedup["time_to_target"]), f"{acc_se(j['results']['sync'])} / {acc_se(j['results'][preset])}"])
    return rows(["preset", "", "ms / sample, sync / preset", "speed-up", "s to target, sync / preset", "sooner",
                 "final avg@1, sync / preset"], body)


def lift(r: dict) -> tuple[float, float]:
    """A run's final accuracy minus its first eval's, and the error of that difference."""
    return (r["final_accuracy"] - r["initial_accuracy"],
            (r["final_accuracy_se"] ** 2 + r["initial_accuracy_se"] ** 2) ** 0.5)


def tool_lift(name: str) -> str:
    """A tool bench's file: each preset's eval at step 0 and at its last step, the lift with its error, and the
    tool calls per sample at the first and the last step."""
    from rlsys.bench import PRESETS

    j = load(name)
    steps = j["workload"]["total_steps"]
    body = []
    for preset, r in sorted(j["results"].items(), key=lambda item: list(PRESETS).index(item[0])):
        gain, se = lift(r)
        body.append([f"`{preset}`", r["repeats"], f"{r['initial_accuracy']:.3f} ± {r['initial_accuracy_se']:.3f}",
                     acc_se(r), f"{gain:+.3f} ± {se:.3f}", f"{gain / se:.0f}" if se else "-",
                     f"{r['tool_calls_first']:.2f} / {r['tool_calls_last']:.2f}"])
    return rows(["preset", "runs", "avg@1 at step 0", f"avg@1 at step {steps}", "lift", "lift / its error",
                 "calls per sample, first / last step"], body)


table("tool_arith")(partial(tool_lift, "tool_arith_cpu"))
table("tool_guess")(partial(tool_lift, "tool_guess_lift_cpu"))


def tool_guess_figures() -> list[str]:
    """The multi-turn task's lift as README quotes it: lift over its error and calls per sample, per preset."""
    return [lift_figures("tool_guess_lift_cpu")]


def lift_figures(name: str) -> str:
    j = load(name)
    parts = []
    for preset, r in j["results"].items():
        gain, se = lift(r)
        parts.append(f"`{preset}` {r['initial_accuracy']:.3f} -> {r['final_accuracy']:.3f} ({gain / se:.1f} times "
                     f"the lift's error), {r['tool_calls_first']:.2f} -> {r['tool_calls_last']:.2f} calls per sample, "
                     f"{r['length_at_cap_last']:.0%} of its last step's samples cut at the length cap")
    return f"in {j['workload']['total_steps']} steps: " + "; ".join(parts)


def tool_guess_peaks() -> str:
    """Each preset's best eval on the way and where it ended: the curve, not only its ends."""
    j = load("tool_guess_lift_cpu")
    peaks = []
    for preset, runs in j["runs"].items():
        curve = runs[0]["eval_curve"]  # (time, accuracy) at step 0 and every eval_every steps to the last
        best = max(range(len(curve)), key=lambda i: curve[i][1])
        step = best * j["workload"]["total_steps"] // (len(curve) - 1)
        peaks.append(f"`{preset}` peaked at {curve[best][1]:.3f} at step {step} and ended at {curve[-1][1]:.3f}")
    return "; ".join(peaks)


def tool_arith_figures() -> list[str]:
    from rlsys.startup import load_config

    j = load("tool_arith_cpu")
    r, workload = j["results"], j["workload"]
    eval_size = load_config(ROOT / workload["config"], workload["overrides"]).data.eval_size
    no_tools = {accuracy for run in j["runs"]["no-tools"] for _, accuracy in run["eval_curve"]}
    tools = [v for k, v in r.items() if k != "no-tools"]
    ratios = [gain / se for gain, se in map(lift, tools)]
    first, last = ([v[f"tool_calls_{end}"] for v in tools] for end in ("first", "last"))
    return [f"lifts the task by {min(ratios):.0f} to {max(ratios):.0f} times its error",
            f"({min(first):.2f} to {max(first):.2f} calls per sample at the first step, {min(last):.2f} to "
            f"{max(last):.2f} at the last)",
            f"when it has one ({load('tool_copy_cpu')['results']['guess']['copy_back']:.3f} below)",
            f"answers {max(no_tools):.3f} of the {eval_size} at every eval" if len(no_tools) == 1 else
            f"no-tools evals differ ({sorted(no_tools)}): the prose says they are equal"]


@table("tool_copy")
def tool_copy() -> str:
    j = load("tool_copy_cpu")
    body = [[f"`{name}`", r["warm_start"]["steps"], f"{r['warm_start']['tool_share']:.1f}",
             f"{r['warm_start']['label_noise']:.1f}", *(num(r[k], 3) for k in ("call_exact", "copy_back", "call_rate"))]
            for name, r in j["results"].items()]
    return rows(["direct answers", "steps", "tool_share", "label_noise", "call written right (greedy)",
                 "tool's answer copied back (greedy)", "starts with a call (temperature 1)"], body)


def loss_grid(conditions: dict[str, str], first_column: str) -> str:
    """Losses x conditions from the loss sweep: each cell the mean final avg@1 over its runs ± its error; the
    losses are those run under every one of the conditions."""
    r = load("loss_sweep_cpu")["results"]
    losses = [loss for loss in dict.fromkeys(k.split("/")[1] for k in r) if all(f"{c}/{loss}" in r for c in conditions)]
    body = [[f"`{loss}`", *(acc_se(r[f"{c}/{loss}"]) for c in conditions)] for loss in losses]
    counts = [sorted({r[f"{c}/{loss}"]["n"] for loss in losses}) for c in conditions]
    body.append(["runs per cell", *("-".join(map(str, dict.fromkeys([n[0], n[-1]]))) for n in counts)])
    return rows([first_column, *conditions.values()], body)


@table("friction")
def friction() -> str:
    start = load("loss_sweep_cpu")["results"]["eta0/dg"]["runs"][0]["initial_accuracy"]
    return loss_grid({"eta0": "`none`", "flipped_rewards": "`flipped_rewards`",
                      "wrong_temperature": "`wrong_temperature`", "all": "`all`"},
                     f"loss (avg@1 at step 0: {start:.3f})")


@table("staleness_ablation")
def staleness_ablation() -> str:
    r = load("loss_sweep_cpu")["results"]
    etas = {f"eta{e}": f"eta {e}" for e in (0, 1, 2, 4)}
    text = loss_grid(etas, "loss")
    return text + "| mean staleness | " + " | ".join(num(r[f"{c}/dg"]["staleness_mean"]) for c in etas) + " |\n"


@table("dg_flip")
def dg_flip() -> str:
    j = load("dg_flip_diagnostic_cpu")
    columns = [(case, loss) for case in ("clean", "flipped") for loss in ("ppo", "dg")]
    keys = ["up on right", "up on wrong", "down on right", "down on wrong"]
    body = [[k, *(f"{j[case][loss][k]:.3f}" for case, loss in columns)] for k in keys]
    body.append(["net on wrong answers (up - down)",
                 *(f"{j[case][loss]['up on wrong'] - j[case][loss]['down on wrong']:+.3f}" for case, loss in columns)])
    return rows(["share of the step's push", *(f"{loss.upper()}, {case}" for case, loss in columns)], body)


@table("mismatch_bf16")
def mismatch_bf16() -> str:
    j = load("mismatch_bf16_cpu")
    body = []
    for name, r in j["results"].items():
        d = r["final_accuracy_vs_uncorrected"]
        vs = "" if name == "bf16-uncorrected" else diff_cell(d, " (beyond error)")
        corrected = r["mismatch_truncated_share_mean"] is not None
        # Files from before the KL was measured in every mode took it, uncorrected, against the engine's own pi_old
        measured = corrected or j.get("mismatch_kl_every_mode", False)
        kl = ([f"{r['mismatch_kl_mean']:.1e}", f"{r['mismatch_kl_max']:.1e}"] if measured else ["not measured", ""])
        kl.append(f"{100 * r['mismatch_truncated_share_mean']:.2f}%" if corrected else "")
        body.append([f"`{name}`", *kl, acc_se(r), vs])
    return rows(["variant", "k3 KL per token, mean", "max step", "tokens truncated", "final avg@1", "vs uncorrected"],
                body)


def losses_beside_dapo(name: str) -> str:
    """benchmarks/losses_round2.py's file: each method beside dapo on the default task, the mean final avg@1
    over the seeds ± its error."""
    from rlsys.bench import accuracy_difference

    r = load(name)["results"]
    start = r["dapo"]["runs"][0]["initial_accuracy"]
    body = []
    for loss, cell in r.items():
        d = accuracy_difference(cell, r["dapo"])
        vs = "" if loss == "dapo" else diff_cell(d, " (beyond error)")
        body.append([f"`{loss}`", acc_se(cell), vs, cell["n"]])
    return rows([f"loss (avg@1 at step 0: {start:.3f})", "final avg@1", "vs dapo", "seeds"], body)


table("losses_round2")(partial(losses_beside_dapo, "losses_round2_cpu"))  # issue 33's losses
table("losses_round3")(partial(losses_beside_dapo, "losses_round3_cpu"))  # SAPO, REINFORCE++, LoRA, PPO with GAE, ...


@table("peer_trl")
def peer_trl() -> str:
    j = load("peer_trl_cpu")
    w, r = j["workload"], j["rlsys_sync"]
    target = w["target_accuracy"]

    def final(runs):  # both sides' repeats share the seed: one eval's error
        return f"{runs[-1]['final_accuracy']:.3f} ± {runs[-1]['final_accuracy_se']:.3f}"
    return rows(["", "TRL", "rlsys `sync`", "TRL / rlsys"], [
        ["step s (training clock / steps)", num(j["step_time_s"]), num(r["step_time_s"]),
         f"{r['trl_over_rlsys_step_time']:.2f}x"],
        [f"s to {target} greedy", num(j["time_to_target_s"], 0), num(r["time_to_target_s"], 0),
         f"{r['trl_over_rlsys_time_to_target']:.2f}x"],
        [f"greedy accuracy at step 0 / {w['steps']} ({w['eval_prompts']} prompts)",
         f"{j['accuracy_curve'][0][2]:.3f} / {final(j['trl_runs'])}",
         f"{r['runs'][0]['accuracy_curve'][0][2]:.3f} / {final(r['runs'])}", ""]])


@table("reward_overlap")
def reward_overlap() -> str:
    j = load("reward_overlap_cpu")
    m = j["median_of_repeats"]
    body = [[name, num(m[name]["timing/step_s"]), num(m[name]["timing/reward_s"]), num(m[name]["generate_and_score_s"])]
            for name in ("overlapped", "after_round")]
    body.append(["gain", f"{j['gain']['timing/step_s']:.2f}x", f"{j['reward_s_hidden']:.2f} s hidden",
                 f"{j['gain']['generate_and_score_s']:.2f}x"])
    return rows(["scoring", "step s", "reward s", "generate and score s"], body)


# --- engine and controller micro-benchmarks ---------------------------------------------------------
@table("engine_throughput")
def engine_throughput() -> str:
    j = load("engine_throughput")
    r = j["results"]
    steps = " / ".join(f"{ms} ms ({n})" for n, ms in j["decode_step_ms_by_batch"].items())
    return rows(["", "value"], [
        ["transformers `generate`, tokens/s", f"{r['hf_generate']['tokens_per_s']:,.0f}"],
        ["built-in engine, tokens/s", f"{r['cpu_engine_wave']['tokens_per_s']:,.0f}"],
        ["speed-up", f"{j['engine_speedup_over_hf_generate']['wall']}x"],
        ["one decode step (sequences running)", steps]])


def engine_grid(name: str) -> str:
    """The built-in engine's decode step on the H100 (ms) by sequences and context, rlsys.costs' vLLM figure after /:
    eager (gpu_engine_h100) and as CUDA graphs (gpu_engine_graph_h100, 2026-11-28)."""
    j = load(name)
    grid = {(r["batch"], str(r["context"])): r for r in j["decode_step_grid"]}
    contexts = ["128", "1024", "4096", "skewed"]
    body = [[b] + [f"{grid[b, c]['step_ms']:.1f} / {grid[b, c]['cost_model_ms']:.1f}" for c in contexts]
            for b in sorted({b for b, _ in grid})]
    body += [[f"prefill {r['batch']} x {r['length']}", f"{r['step_ms']:.1f} / {r['cost_model_ms']:.1f}", "", "", ""]
             for r in j["prefill_grid"]]
    return rows(["sequences", *(f"context {c}" for c in contexts)], body)


table("gpu_engine")(partial(engine_grid, "gpu_engine_h100"))
table("gpu_engine_graph")(partial(engine_grid, "gpu_engine_graph_h100"))


@table("gpu_runs")
def gpu_runs() -> str:
    j = load("gpu_runs_h100")
    body = []
    for name, r in j["runs"].items():
        body.append([f"`{name}`", r["date"], r["attention"], r["steps"], " / ".join(f"{s:.1f}" for s in r["step_s"]),
                     f"`{r['transport']}`", " / ".join(f"{s:.3f}" for s in r["weight_sync_s"]),
                     num(r["peak_gpu_memory_mib"], 0)])
    return rows(["run", "date", "engine's attention", "steps", "step s", "transport", "weight publish s",
                 "peak GPU MiB"], body)


@table("running_requests")
def running_requests() -> str:
    j = load("running_requests_cpu")
    return rows(["`weights.running_requests`", "cost of one weight update, ms"], [
        ["`keep`", j["update_ms"]["keep"]],
        ["`recompute`", f"{j['update_ms']['recompute']} (about {j['recompute_extra_in_decode_steps']} decode steps)"]])


@table("controller_load")
def controller_load() -> str:
    j = load("controller_load_cpu")
    return rows(["scheduler", "events a step", "events / s", "us / event", "share of simulated time"], [
        [f"`{name}`", f"{r['events_per_step']:,.0f}", f"{r['events_per_s']:,.0f}", num(r["controller_us_per_event"], 1),
         f"{100 * r['controller_share_of_simulated_time']:.2f}%"] for name, r in j["results"].items()])


# --- the cluster simulator ----------------------------------------------------------------------------
@table("emulate_time_scale")
def emulate_time_scale() -> str:
    return rows(["preset", "time scale", "overrun share", "worst step's", "emulating (<= 5%)", "step s"], [
        [f"`{r['preset']}`", r["time_scale"], f"{r['overrun_share']:.3f}", f"{r['worst_step_overrun_share']:.3f}",
         "yes" if r["emulating"] else "no", num(r["step_s"], 1)] for r in load("emulate_time_scale_cpu")["runs"]])


@table("emulated_vs_sim")
def emulated_vs_sim() -> str:
    j = load("emulated_vs_sim_cpu")
    def cell(f: dict) -> str:
        digits = 2 if f["live"] < 1 else 1
        return f"{f['live']:.{digits}f} / {f['sim']:.{digits}f} ({f['sim_over_live']:.2f})"
    return rows(["preset", "overrun share", "step s, live / sim (sim/live)", "rollout s", "bubble ratio"], [
        [f"`{name}`", f"{r['overrun_share']:.3f}", cell(r["step_time_s"]), cell(r["rollout_time_s"]),
         cell(r["bubble_ratio"])] for name, r in j["results"].items()])


def worst_overrun(r: dict) -> str:
    """The highest overrun share among a preset's seeds (the aggregate keeps the median and its spread), and the
    most emulated seconds a seed's real compute ran past its modelled time, where the file has them."""
    def worst(key: str) -> float:
        return max(r.get(f"{key}_spread") or [r[key]])
    return f"{worst('overrun_share'):.3f}" + (f" ({worst('overrun_s'):.1f} s)" if r.get("overrun_s") is not None else "")


def emulated_rows(name: str) -> list[list]:
    """`rlsys bench` on an emulated clock: each preset's worst overrun share, its figures with [min, max] over
    seeds, and its time to target and speed against sync as the median [min, max] of the seeds' pairs."""
    j = load(name)

    def pairs(preset: str, key: str) -> str:
        s = j["speedup_vs_sync"][preset]
        return "" if preset == "sync" else (ratio_cell(s[key], s[key + "_spread"]) if s[key]
                                             else "not every seed reached it")
    return [[f"`{preset}`", worst_overrun(r),
             spread(r, "step_time_s", 1), spread(r, "bubble_ratio", 2), spread(r, "straggler_rate", 2),
             spread(r, "time_to_target_s", 0), acc_se(r), versus_sync(j, preset), spread(r, "accuracy_at_equal_time"),
             pairs(preset, "per_sample"), pairs(preset, "time_to_target")]
            for preset, r in j["results"].items()]


EMULATED_HEADER = ["preset", "worst overrun share", "step s", "bubble", "straggler", "to target s", "final avg@1",
                   "final vs sync", "avg@1 at equal time", "speed per sample vs sync", "sooner to target vs sync"]


@table("emulated_h100_7b")
def emulated_h100_7b() -> str:
    return rows(EMULATED_HEADER, emulated_rows("emulated_h100_7b"))


def emulated_budget_rows(name: str) -> list[list]:
    """benchmarks/emulated_budget.py's file: every preset on one budget of modelled GPUs, GPU-seconds beside
    the figures, each ratio to sync with its bootstrap 95% interval over the seeds' pairs."""
    j = load(name)

    def ratio(preset: str, key: str) -> str:
        s = j["speedup_vs_sync"][preset]
        if preset == "sync":
            return ""
        return budget_ratio(s, key) + (" (budgets differ)" if s["budgets_differ"] else "")
    return [[f"`{preset}`", f"{r['gpus']:g}", r["repeats"], worst_overrun(r), spread(r, "step_time_s", 1),
             spread(r, "gpu_s_per_sample", 3), spread(r, "gpu_s_to_target", 0), acc_se(r), versus_sync(j, preset),
             ratio(preset, "per_sample_gpu_s"), ratio(preset, "time_to_target_gpu_s")]
            for preset, r in sorted(j["results"].items(), key=lambda item: item[0] != "sync")]  # sync, the baseline, first


EMULATED_BUDGET_HEADER = ["preset", "modelled GPUs", "seeds", "worst overrun share (s)", "step s", "GPU-s / sample",
                          "GPU-s to target", "final avg@1", "final vs sync", "per GPU-second vs sync [95% CI]",
                          "sooner to target (GPU-s) vs sync [95% CI]"]


def four_gpu_figures() -> list[str]:
    """The four-GPU budget beside the two-GPU one: each preset's ratio to sync per GPU-second on both."""
    two, four = (load(f"emulated_budget_longcot_{b}gpu")["speedup_vs_sync"] for b in (2, 4))
    return ["; ".join(f"`{p}` {budget_ratio(four[p], 'per_sample_gpu_s')} per GPU-second on four against "
                      f"{two[p]['per_sample_gpu_s']:.2f}x on two" for p in four if p != "sync")]


@table("emulated_budget_summary")
def emulated_budget_summary() -> str:
    """docs/schedulers.md's summary of the equal-budget reruns: cot_sum on two and on four modelled GPUs, each preset's
    ratios to sync per GPU-second and to target (bootstrap 95% intervals over the seeds' pairs) and its final
    accuracy against sync's."""
    budgets = {b: load(f"emulated_budget_longcot_{b}gpu") for b in (2, 4)}
    presets = list(dict.fromkeys(p for j in budgets.values() for p in j["speedup_vs_sync"] if p != "sync"))

    def cells(j: dict, preset: str) -> list[str]:
        s = j["speedup_vs_sync"].get(preset)
        if s is None:
            return ["not run"] * 3
        d = s["final_accuracy_vs_sync"]
        return [f"{budget_ratio(s, 'per_sample_gpu_s')} ({j['results'][preset]['repeats']} seeds)",
                budget_ratio(s, "time_to_target_gpu_s"), diff_cell(d)]
    return rows(["preset", *(f"{b} GPUs: {what}" for b in budgets
                             for what in ("per GPU-second vs sync", "sooner to target", "final vs sync"))],
                [[f"`{p}`", *(c for j in budgets.values() for c in cells(j, p))] for p in presets])


def length_shape(name: str) -> str:
    """Each preset's length shape at its first and last step: median, p90, p99 (tokens), share at the cap."""
    return rows(["preset", "p50 first → last", "p90 first → last", "p99 first → last", "at the cap first → last"], [
        [f"`{preset}`", *(f"{r[f'length_{k}_first']:.0f} → {r[f'length_{k}_last']:.0f}" for k in ("p50", "p90", "p99")),
         f"{r['length_at_cap_first']:.1%} → {r['length_at_cap_last']:.1%}"]
        for preset, r in load(name)["results"].items()])


# Each equal-budget file renders its table under its own name; the cot_sum ones at two GPUs their length shapes too
for _name in ("emulated_budget_old_2gpu", "emulated_budget_old_4gpu", "emulated_budget_longcot_2gpu",
              "emulated_budget_longcot_4gpu", "emulated_budget_longcot32_2gpu"):
    table(_name)(partial(lambda name: rows(EMULATED_BUDGET_HEADER, emulated_budget_rows(name)), _name))
for _name in ("emulated_budget_longcot_2gpu", "emulated_budget_longcot32_2gpu"):
    table(f"{_name}_lengths")(partial(length_shape, _name))


@table("emulated_h100_7b_sagc")
def emulated_h100_7b_sagc() -> str:
    """SAGC against static group sizes under `sorted`, on the drifting workload: every figure over seeds."""
    j = load("emulated_h100_7b_sagc")
    return rows(["preset", "mean G", "worst overrun share", "step s", "straggler", "bubble", "to target s",
                 "final avg@1", "avg@1 at equal time"], [
        [f"`{preset}`", spread(r, "group_size", 1), worst_overrun(r),
         spread(r, "step_time_s", 1), spread(r, "straggler_rate", 3), spread(r, "bubble_ratio", 2),
         spread(r, "time_to_target_s", 0), acc_se(r), spread(r, "accuracy_at_equal_time")]
        for preset, r in j["results"].items()])


def sim_cell(f: dict) -> str:
    """A replayed figure: live and simulated means over the seeds, and the median [min, max] of the seeds'
    sim/live."""
    digits = 2 if f["live"] < 1 else 1
    lo, hi = f["sim_over_live_spread"]
    return f"{f['live']:.{digits}f} / {f['sim']:.{digits}f} ({f['sim_over_live']:.2f} [{lo:.2f}, {hi:.2f}])"


@table("emulated_vs_sim_bench")
def emulated_vs_sim_bench() -> str:
    """The simulator replaying every run of the emulated comparison."""
    return rows(["preset", "seeds", "worst overrun share", "step s, live / sim (sim/live [min, max])", "rollout s",
                 "bubble ratio"], [
        [f"`{name}`", r["seeds"], f"{r['overrun_share']:.3f}", sim_cell(r["step_time_s"]),
         sim_cell(r["rollout_time_s"]), sim_cell(r["bubble_ratio"])]
        for name, r in load("emulated_vs_sim_bench_cpu")["results"].items()])


def emulated_budget_vs_sim(name: str) -> str:
    """The simulator replaying the equal-budget runs on their own budget, GPU-seconds per sample beside time."""
    return rows(["preset", "modelled GPUs", "seeds", "worst overrun share", "step s, live / sim (sim/live [min, max])",
                 "rollout s", "bubble ratio", "GPU-s / sample"], [
        [f"`{preset}`", r["gpus"], r["seeds"], f"{r['overrun_share']:.3f}", sim_cell(r["step_time_s"]),
         sim_cell(r["rollout_time_s"]), sim_cell(r["bubble_ratio"]), sim_cell(r["gpu_s_per_sample"])]
        for preset, r in sorted(load(name)["results"].items())])


# the simulator's replays of the equal-budget files: each renders its table and is quoted in docs/emulation.md
BUDGET_REPLAYS = ("emulated_budget_vs_sim_longcot32_2gpu", "emulated_budget_vs_sim_longcot_2gpu",
                  "emulated_budget_vs_sim_longcot_4gpu", "emulated_budget_vs_sim_old_2gpu",
                  "emulated_budget_vs_sim_old_4gpu")
for _name in BUDGET_REPLAYS:
    table(_name)(partial(emulated_budget_vs_sim, _name))


@table("sim_sagc")
def sim_sagc() -> str:
    r = load("sim_sagc_7b_8k")["results"]
    cell = lambda key: f"{r[key]['step_time_s']:.1f} s, {r[key]['straggler_rate']:.2f}"  # noqa: E731
    return rows(["", "G 4", "G 8", "G 16", "sagc"], [
        ["sync, 1,024 samples a step", *(cell(f"sync-{g}") for g in ("G4", "G8", "G16", "sagc"))],
        ["sorted, 1,024 samples a step", *(cell(f"sorted-{g}") for g in ("G4", "G8", "G16", "sagc"))],
        ["sync, 128 prompts a step", cell("sync-G4-128prompts"), cell("sync-G8"),
         cell("sync-G16-128prompts"), cell("sync-sagc-128prompts")]])


@table("sim_calibration")
def sim_calibration() -> str:
    """Each row in sample, on the held-out model (every paper held out) and with one RollPacker setting held out at
    a time; a miss's note, held out first."""
    j = load("sim_calibration")
    out = {r["name"]: r for r in j["rows_out_of_sample"]}
    one = {r["name"]: r for r in j["rows_one_out"]}
    kind = lambda r: "fitted" if r["fitted"] else f"same as {r['same_as']}" if "same_as" in r else "counted"  # noqa: E731
    yes = lambda r: "named" if "in_sample_by" in r else "yes" if r["within"] else "no"  # noqa: E731
    cell = lambda r: f"{r['simulated']} ({r['ratio']})"  # noqa: E731
    return rows(["setup", "experiment", "published", "in sample", "row in sample", "held out", "one setting out",
                 "within 15% (in / held out / one out)", "note"], [
        [r["name"], r["experiment"], r["published"], cell(r), kind(r), cell(out[r["name"]]), cell(one[r["name"]]),
         f"{yes(r)} / {yes(out[r['name']])} / {yes(one[r['name']])}",
         out[r["name"]].get("in_sample_by") or out[r["name"]].get("note") or r.get("note", "")] for r in j["rows"]])


@table("sim_hits")
def sim_hits() -> str:
    """Rows within 15% per independent experiment, in sample, held out and one RollPacker setting out at a time."""
    j = load("sim_calibration")
    hits = j["hit_rate"]
    keys = ("in_sample", "out_of_sample", "one_setting_out")
    names = list(dict.fromkeys(e for k in keys for e in hits[k]["by_experiment"]))
    cell = lambda k, e: "{within} of {rows}".format(**hits[k]["by_experiment"][e]) \
        if e in hits[k]["by_experiment"] else "none counted"  # noqa: E731
    body = [[e, *(cell(k, e) for k in keys)] for e in names]
    body.append(["rows in all", *(f"{hits[k]['within']} of {hits[k]['rows']}" for k in keys)])
    body.append(["experiments with every row within",
                 *(f"{hits[k]['experiments_within']} of {hits[k]['experiments']}" for k in keys)])
    body.append(["experiments' mean share within", *(f"{hits[k]['experiment_share']:.2f}" for k in keys)])
    return rows(["experiment", "in sample", "held out", "one setting out"], body)


@table("sim_per_setting")
def sim_per_setting() -> str:
    """The values set per setting or from RollPacker's rows, where each came from and the rows it touched."""
    import yaml

    j = load("sim_calibration")
    fits, shared, one = j["step_overheads"], j["constants"]["engine.step_overhead_ms"], j["step_overheads_one_out"]
    reaches = {"qwen14b_16k": " and the `scaling 14b_16k` rows"}
    body = [[f"`engine.step_overhead_ms` of `{c}`", f"{f['step_overhead_ms']} ms",
             f"fitted in sample to veRL's {f['target_rollout_s']} s rollout at the cited median (bisection in log "
             f"over {f['searched_ms'][0]}-{f['searched_ms'][1]:.0f} ms, `fit_overhead`); held out the shared "
             f"{shared} ms, one setting out {one[c]} ms (the other settings' fits' geometric mean)",
             f"`{c} rollout veRL s`; through the engine, every `{c}` row in sample{reaches.get(c, '')}"]
            for c, f in fits.items()]
    median = {f["median_tokens"] for f in fits.values()}.pop()
    body.append([f"`workload.median_tokens` of {', '.join(f'`{c}`' for c in fits)}, `verl_async_7b_28k`",
                 f"{median:,}", "TailSieve's measured median (\"Calibration sources\"), not fitted: in sample and "
                 "held out alike", "every row of those settings"])
    artifact = "RollPacker's artifact (github.com/Farrrrland/RollPacker, examples/stream_trainer_table3/" \
               "rlvr_config_stream_trainer_7B.yaml), its setup, not fitted, but read after the held-out count " \
               "stood at 8 of 28 (it moved it to 12): "
    for c in fits:
        raw = yaml.safe_load((ROOT / "configs" / "sim" / f"{c}.yaml").read_text())
        pools = ", ".join(f"{name} {kind['workers']}" for name, kind in raw["reward"]["kinds"].items())
        body.append([f"`reward.kinds.*.workers` of `{c}`", pools,
                     artifact + "`rewards.math_rule.world_size` and `rewards.code_sandbox.world_size` 32, "
                     "`llm_judge` on every GPU of the job (`device_mapping`)", f"every `{c}` row, in and held out"])
        engine = raw["engine"]
        body.append([f"`engine.max_seqs`, `engine.memory_fraction` of `{c}`",
                     f"{engine['max_seqs']}, {engine['memory_fraction']}",
                     artifact + "vLLM's `max_num_seqs` and `gpu_memory_utilization`",
                     f"every `{c}` row, in and held out"])
    fit = j["tp_fit"]
    body.append(["`workload.median_tokens` of `qwen3_8b_32k_tp`", "7,500",
                 "set by hand to RollPacker's TP1 short round (1,029 s) under the earlier 2.9 ms step overhead; held "
                 "out the cited median", "the two `qwen3-8b/32k` rows in sample"])
    body.append(["`engine.tp_efficiency` (all configs)", fit["tp_efficiency"],
                 "fitted to RollPacker's TP2:TP1 rounds (`tp_fit`); held out 1.0 (an ideal split)",
                 "the two `qwen3-8b/32k` rows; every TP2 engine (14B, 32B) in sample"])
    body.append(["`control.elastic_tp.long_rounds_at_base`", "true",
                 "RollPacker's TP study (its long rounds slower at TP2): a long round at most at `cluster.tp`; held "
                 "out false (the cost model's TP)", "the planner rows (`+planner`) and the `scaling` rows in sample"])
    body.append(["the trainer's MFU law's shape (a cost per data-parallel GPU)", "`comm_per_gpu` 0.0134",
                 "Megatron's MFU on 8 / 16 / 32 GPUs (\"Calibration sources\"); the shape was chosen while matching "
                 "RollPacker's scaling rows", "the `scaling 14b_16k` rows: named, not counted held out"])
    return rows(["value", "in sample", "from", "rows it touched"], body)



@table("sim_gpus")
def sim_gpus() -> str:
    from rlsys.costs import GPUS

    return rows(["gpu", "memory GB", "HBM TB/s", "dense BF16 TFLOP/s"],
                [[f"`{name}`", f"{g.memory / 1e9:.0f}", f"{g.bandwidth / 1e12:.2f}", f"{g.peak_flops / 1e12:.0f}"]
                 for name, g in GPUS.items()])


def sweep_groups(sweep: dict) -> dict[tuple, list[dict]]:
    """The sweep's points, their seeds together, in the file's order."""
    groups = {}
    for p in sweep["points"]:
        groups.setdefault((p["runaway_share"], p["mfu"], p["step_overhead"], p["length"]), []).append(p)
    return groups


def seeds_cell(points: list[dict], schedule: str) -> str:
    """A schedule's speed-up over a point's seeds: the mean [least, most], and in how many seeds it trained less
    (or otherwise) than veRL."""
    es = [e for p in points for e in p["ranked"] if e["schedule"] == schedule]
    if not es:
        return ""
    xs = [e["speedup_vs_sync"] for e in es]
    unequal = sum(not e["equal_utility"] for e in es)
    return (f"{sum(xs) / len(xs):.2f}x [{min(xs):.2f}, {max(xs):.2f}]"
            + (f" (unequal in {unequal} of {len(es)})" if unequal else ""))


def best_cell(points: list[dict], key: str) -> str:
    bests = [p[key] for p in points if p[key]]
    if not bests:
        return "none at equal utility"
    xs = [b["speedup_vs_sync"] for b in bests]
    names = ", ".join(f"`{n}`" for n in dict.fromkeys(b["schedule"] for b in bests))
    return f"{names} {min(xs):.2f}x-{max(xs):.2f}x" + (f" ({len(bests)} of {len(points)} seeds)"
                                                        if len(bests) < len(points) else "")


@table("sim_128_sweep")
def sim_128_sweep() -> str:
    """The 128-GPU sweep on the held-out model: per point (its seeds together) veRL's step and each schedule's
    speed-up, the anchored ones first; the best anchored schedule at equal utility and the best unvalidated one."""
    j = load("sim_128_sweep")
    anchored = list(j["anchored"])
    others = sorted({e["schedule"] for p in j["points"] for e in p["ranked"]} - {"veRL-sync", *anchored})
    verl = lambda ps, key: sum(next(e for e in p["ranked"] if e["schedule"] == "veRL-sync")[key]  # noqa: E731
                               for p in ps) / len(ps)
    return rows(["runaway share", "trainer MFU on 128", "step overhead ms", "median, spread",
                 "veRL step s (rollout, train)", *[f"`{n}`" for n in anchored],
                 *[f"`{n}` (unvalidated)" for n in others], "best anchored", "best unvalidated"], [
        [f"{k[0]:.3f}", f"{ps[0]['trainer_mfu_128']:.2f} ({k[1]})", f"{ps[0]['step_overhead_ms']} ({k[2]})",
         f"{ps[0]['median_tokens']:,.0f}, {ps[0]['sigma']} ({k[3]})",
         f"{verl(ps, 'step_time_s'):.0f} ({verl(ps, 'rollout_time_s'):.0f}, {verl(ps, 'train_time_s'):.0f})",
         *[seeds_cell(ps, n) for n in anchored + others], best_cell(ps, "best"), best_cell(ps, "best_unvalidated")]
        for k, ps in sweep_groups(j).items()])


def span(xs: list[float], unit: str = "") -> str:
    """The least and the most of some ratios, as prose quotes a range."""
    return f"{min(xs):.2f}{unit}-{max(xs):.2f}{unit}"


def findings(j: dict) -> str:
    """What the rows say, from the calibration's figures, and why the step overhead, not the median, is fitted in
    sample: the run that fitted the median (sim_calibration_median_fit) against the held-out decode rates."""
    before = load("sim_calibration_median_fit")
    row = {r["name"]: r for r in j["rows"]}
    held = {r["name"]: r for r in j["rows_out_of_sample"]}
    old = {r["name"]: r for r in before["rows"]}
    settings = list(j["step_overheads"])
    ratios = lambda rows, label: [rows[f"{c} {label}"]["ratio"] for c in settings]  # noqa: E731
    overheads = " / ".join(f"{f['step_overhead_ms']}" for f in j["step_overheads"].values())
    medians = " / ".join(f"{m['median_tokens']:,}" for m in before["medians"].values())
    stack = "tail+reward+planner+stream speedup"
    over = [held[f"{c} {s} speedup"]["ratio"] for c in ("qwen14b_16k", "qwen32b_32k")
            for s in ("tail", "tail+reward", "tail+reward+planner+stream")]
    was = before["hit_rate"]["in_sample"]
    a, wait = held["verl fully-async speedup (2.35-2.67)"], held["verl rollout wait async s"]
    per_token = [held[f"{c} rollout veRL s"]["why"] for c in settings]
    ms = lambda key: " / ".join(f"{w[key]:.1f}" for w in per_token)  # noqa: E731
    gap = " / ".join(f"{w['published_ms_per_token'] - w['ms_per_token']:.1f}" for w in per_token)
    train = a.get("why")
    trainer = (f"The page trains with FSDP2 on H20s, and the law (Megatron's, measured on 8-32 GPUs) gives a colocated "
               f"step {train['train_s']:.0f} s of training on 128 GPUs and async's trainer "
               f"{train['async_train_s']:.0f} s on 64, against the page's own phase columns of "
               f"{train['published_train_s']:.0f} s and {train['published_async_train_s']:.0f} s "
               f"({train['train_s'] / train['published_train_s']:.1f}x and "
               f"{train['async_train_s'] / train['published_async_train_s']:.1f}x): the law carried to another "
               f"framework, another GPU and four times the GPUs it was measured on; it is not refitted to the page, "
               f"whose rows would then be in sample") if train else "The page's async speed-up lands"
    return (f"In sample RollPacker's settings keep TailSieve's median and each fits its engine's per-step overhead "
            f"to its veRL rollout: {overheads} ms (7B / 14B / 32B) against the shared "
            f"{j['constants']['engine.step_overhead_ms']} ms. Fitting the median instead "
            f"(benchmarks/results/sim_calibration_median_fit.json, the run before this design) drove it to {medians} "
            f"tokens, several times the 755-1,100 token P75 RollPacker reports at 14B (§2.2): veRL's rollout is "
            f"bound by its longest samples, so only long lengths could slow it, and with them tail's rollout came "
            f"out {span(ratios(old, 'rollout tail s'))}x the published and the full stack "
            f"{span(ratios(old, stack))} of its published speed-up, {was['within']} of {was['rows']} counted rows "
            f"within 15%. Held out, at the cited median and the shared overhead, the cost model decodes those "
            f"rollouts, which run to the cap, at {ms('ms_per_token')} ms a token against the "
            f"{ms('published_ms_per_token')} ms the published rollouts imply, {gap} ms a decode step missing: a "
            f"cost per step of those systems' decode (framework and host), not the lengths. With the fitted "
            f"overheads tail's rollout is {span(ratios(row, 'rollout tail s'))}x the published and the full stack "
            f"{span(ratios(row, stack))} of its published speed-up, in sample. Held out, the veRL rollouts come out "
            f"{span(ratios(held, 'rollout veRL s'))} of the published and the 14B and 32B speed-ups {span(over)} of "
            f"theirs. veRL's fully-async page, held out: async is {a['simulated']:.2f}x against {a['published']}x, "
            f"its trainer waiting {wait['simulated']:.0f} s a step against {wait['published']} s. {trainer}")


def sweep_seeds(sweep: dict, runaway: float = 0.01, mfu: str = "law", overhead: str = "shared",
                length: str = "cited") -> list[dict]:
    return sweep_groups(sweep)[(runaway, mfu, overhead, length)]


def best_mean(points: list[dict]) -> str:
    """The best anchored schedule's mean speed-up over a point's seeds where one trains what veRL trains."""
    xs = [p["best"]["speedup_vs_sync"] for p in points if p["best"]]
    if not xs:
        return "none at equal utility"
    return f"{sum(xs) / len(xs):.2f}x" + (f" ({len(xs)} of {len(points)} seeds at equal utility)"
                                          if len(xs) < len(points) else "")


def hits_phrase(h: dict) -> str:
    return (f"{h['within']} of {h['rows']} counted rows and {h['experiments_within']} of {h['experiments']} "
            f"experiments whole (each experiment's share within, averaged: {h['experiment_share']:.2f})")


def anchors_phrase(j: dict) -> str:
    """How far off its anchors the headline's model is held out, at 32B, and which way the range may be off."""
    held = {r["name"]: r["ratio"] for r in j["rows_out_of_sample"]}
    tail, reward, stack = (held[f"qwen32b_32k {s} speedup"] for s in ("tail", "tail+reward",
                                                                      "tail+reward+planner+stream"))
    way = "low" if max(tail, reward) < 1 else "high" if min(tail, reward) > 1 else "either way"
    return (f"held out, the simulator puts the 32B setting's tail and tail+reward speed-ups at {tail:.2f}x and "
            f"{reward:.2f}x the published (the stack with the planner and the stream trainer at {stack:.2f}x), so "
            f"`tail/G4`'s figures may run {way} by as much")


def sim_figures() -> dict[str, str]:
    """The simulator's figures as docs/schedulers.md and docs/performance.md quote them, from the calibration and the sweep."""
    j, sweep = load("sim_calibration"), load("sim_128_sweep")
    hits, held, one = (j["hit_rate"][k] for k in ("in_sample", "out_of_sample", "one_setting_out"))
    s = sweep["summary"]
    low, high = s["best_speedup_range"]
    centre = sweep_seeds(sweep)
    runaway = [sweep_seeds(sweep, x) for x in (0.0, 0.01, 0.03)]
    mfu = {m: sweep_seeds(sweep, mfu=m) for m in ("rollpacker table 1", "megatron-lm pretraining")}
    lengths = {n: sweep_seeds(sweep, length=n) for n in ("sigma 0.5", "rollpacker p75")}
    held_32b = sweep_seeds(sweep, overhead="held out for 32B")
    unvalidated = {n: v for n, v in s["by_schedule"].items() if not v["anchored"]}
    sorted_runs = unvalidated.get("sorted-partial-K4/G4")
    asyncs = [v for n, v in unvalidated.items() if n.startswith("async")]
    return {
        "in_sample": f"{hits['within']} of {hits['rows']} counted rows land within 15% in sample "
                     f"({sum(r['fitted'] for r in j['rows'])} more were fitted)",
        "held_out": f"on the held-out model, every paper held out, {hits_phrase(held)}",
        "one_out": f"with one RollPacker setting held out at a time (its step overhead the other two settings' "
                   f"fits' geometric mean), {hits_phrase(one)}",
        "range": f"the best schedule with a published anchor is {low:.2f}x to {high:.2f}x sync over the "
                 f"{len(sweep['points']) - s['unranked']} of {len(sweep['points'])} runs where one trains what veRL "
                 f"trains",
        "centre": f"at 1% runaway, the law's MFU, the shared step overhead and the cited lengths it is "
                  f"{best_mean(centre)} over {len(centre)} seeds "
                  f"({span([p['best']['speedup_vs_sync'] for p in centre if p['best']], 'x')})",
        "runaway": "over runaway shares of 0%, 1% and 3% the best anchored schedule runs "
                   + ", ".join(best_mean(ps) for ps in runaway),
        "mfu": f"at the MFU RollPacker's Table 1 implies ({mfu['rollpacker table 1'][0]['trainer_mfu_128']:.2f} on "
               f"128 GPUs) {best_mean(mfu['rollpacker table 1'])}, at Megatron-LM's pretraining MFU (0.35) "
               f"{best_mean(mfu['megatron-lm pretraining'])}",
        "lengths": f"at a length spread of 0.5 {best_mean(lengths['sigma 0.5'])}, at RollPacker's P75 (median "
                   f"{lengths['rollpacker p75'][0]['median_tokens']:,.0f}) {best_mean(lengths['rollpacker p75'])}",
        "overhead": f"at the step overhead held out for the 32B setting ({held_32b[0]['step_overhead_ms']} ms) "
                    f"{best_mean(held_32b)}",
        "unvalidated": "unvalidated: " + "; ".join(
            ([f"`sorted-partial-K4/G4` {sorted_runs['min']:.2f}x-{sorted_runs['max']:.2f}x at equal utility "
              f"({sorted_runs['runs']} of {len(sweep['points'])} runs)"] if sorted_runs else [])
            + ([f"async {min(v['min'] for v in asyncs):.2f}x-{max(v['max'] for v in asyncs):.2f}x over its splits"]
               if asyncs else [])),
        "anchors": anchors_phrase(j),
        "findings": findings(j),
        "wall": f"the JSON's run took {j['wall_s']:.0f} s on the 2-core machine at load "
                f"{j['machine']['load_average_at_start']:.1f}, {j['cpu_s']:.0f} CPU seconds in all",
    }


def loss_sweep_figures() -> list[str]:
    """The staleness ablation's differences as docs/performance.md quotes them."""
    from rlsys.bench import accuracy_difference

    r = load("loss_sweep_cpu")["results"]
    d = lambda a, b: "{diff:+.3f} ± {se:.3f}".format(**accuracy_difference(r[a], r[b]))  # noqa: E731
    return [f"eta 4 against eta 0 is {d('eta4/ppo_naive', 'eta0/ppo_naive')}",
            f"against eta 0: {d('eta4/decoupled_ppo', 'eta0/decoupled_ppo')}; against naive PPO at eta 4: "
            f"{d('eta4/decoupled_ppo', 'eta4/ppo_naive')}",
            f"({r['all/decoupled_ppo']['final_accuracy']:.3f} against {r['all/ppo_naive']['final_accuracy']:.3f})"]


def dg_net(loss: str) -> str:
    """The range over the diagnostic's draws of the net push on wrong answers under flipped rewards."""
    nets = [r["flipped"][loss]["up on wrong"] - r["flipped"][loss]["down on wrong"]
            for r in load("dg_flip_diagnostic_cpu")["seeds"]]
    return f"{min(nets):+.3f} to {max(nets):+.3f}"


def async_profile_shares() -> tuple[float, float]:
    """How much longer a train step runs beside the engine than alone, and the trainer's wait between steps,
    each in % (of the step alone, of the async step)."""
    r = load("async_profile_cpu")["results"]
    fast, alone = r["async-loglinear"], r["sync"]["median"]["train_s"]
    return (100 * (fast["median"]["train_s"] / alone - 1),
            100 * fast["trainer_idle_between_steps_s"] / fast["median"]["step_s"])


def async_profile_figures() -> list[str]:
    """docs/performance.md's reading of benchmarks/async_profile.py."""
    r = load("async_profile_cpu")["results"]
    fast, sync = r["async-loglinear"], r["sync"]
    cores, train, alone = fast["cores_in_window"], fast["median"]["train_s"], sync["median"]["train_s"]
    longer, waiting = async_profile_shares()
    return [f"processes use {fast['cores_total']:.2f} of the 2 cores (trainer {cores['ray::TrainerWorker']:.2f}, "
            f"rollout worker {cores['ray::RolloutWorker']:.2f}, controller {cores['controller']:.2f}, reward actor "
            f"{cores['ray::RewardWorker']:.2f})",
            f"takes {train:.3f} s beside the engine against {alone:.3f} s alone under `sync` ({longer:.0f}% longer)",
            f"the trainer waits {fast['trainer_idle_between_steps_s']:.3f} s",
            f"{waiting:.0f}% of the step",
            f"about {sync['median']['step_s'] / train:.2f}x sync per sample in this run"]


def emulated_vs_sim_figures() -> list[str]:
    """docs/emulation.md's reading of the simulator against the live emulated runs."""
    r = load("emulated_vs_sim_cpu")["results"]
    figures = {"step_time_s": "step time", "rollout_time_s": "rollout time", "bubble_ratio": "bubble ratio"}
    def verdict(f: str) -> str:
        off = {name: abs(1 - v[f]["sim_over_live"]) for name, v in r.items()}
        missed = [name for name, d in off.items() if d > 0.1]
        within = f"{figures[f]} within {100 * max(d for name, d in off.items() if name not in missed):.0f}%"
        return within + "".join(f" but for `{name}` ({r[name][f]['sim_over_live']:.2f})" for name in missed)
    train = max(abs(1 - v["sim_train_time_s"] / v["live_train_time_s"]) for v in r.values())
    unpaced = [r[name]["live_unaccounted_s"] for name in ("sync", "tail", "sorted")]
    share = max(r[name]["live_unaccounted_s"] / r[name]["step_time_s"]["live"] for name in ("sync", "tail", "sorted"))
    at_01 = next(x for x in load("emulate_time_scale_cpu")["runs"] if x["preset"] == "sync" and x["time_scale"] == 0.1)
    return [f"step is {r['sync']['step_time_s']['live']:.0f} s at 0.25 and {at_01['step_s']:.0f} s at 0.1",
            f"**Simulated over live:** {', '.join(verdict(f) for f in figures)}.",
            f"agrees** within {100 * train:.0f}% everywhere",
            f"came to {min(unpaced):.2f}-{max(unpaced):.2f} emulated seconds per step",
            f"at most {100 * share:.1f}% of a step",
            f"the simulator's is {r['async']['bubble_ratio']['sim_over_live']:.2f} of the live run's"]


def emulated_sagc_figures() -> list[str]:
    """docs/emulation.md's reading of SAGC against static group sizes on the emulated clock."""
    r = load("emulated_h100_7b_sagc")["results"]
    sagc, g4, g8, g16 = r["sorted+sagc"], r["sorted+G4"], r["sorted"], r["sorted+G16"]
    return [f"(mean G {sagc['group_size']:.1f})",
            f"straggler rate met the budget ({sagc['straggler_rate']:.3f} against 0.01; G16 "
            f"{g16['straggler_rate']:.3f}, G8 {g8['straggler_rate']:.3f}, G4 {g4['straggler_rate']:.3f})",
            f"(median {sagc['time_to_target_s']:.0f} s against G8's {g8['time_to_target_s']:.0f} s and G4's "
            f"{g4['time_to_target_s']:.0f} s",
            f"G16's step is the fastest, {g16['step_time_s']:.1f} s against G8's {g8['step_time_s']:.1f} s"]


def emulated_speeds() -> dict[str, float]:
    s = load("emulated_h100_7b")["speedup_vs_sync"]
    return {"tail": s["tail"]["per_sample"], "streamed": s["tail-streamed"]["per_sample"],
            "eta2": s["async-eta2"]["time_to_target"]}


def budget_ratio(s: dict, key: str, what: str = "") -> str:
    """A ratio to sync with its bootstrap 95% interval and `what` it measures; a time to target some seed never
    reached has none."""
    if s[key] is None:
        return "undefined (a seed ended below the target)"
    return ratio_cell(s[key], s[key + "_ci95"]) + (" " + what if what else "")


# the equal-budget targets, set against RollPacker's 7B/8k figures (tail 1.30x; the full system 2.03x, less a margin)
TAIL_TARGET, BEST_TARGET = 1.3, 1.8


def short_by(x: float, target: float) -> str:
    """How far a ratio falls below its target, as the prose spells it."""
    return f"{100 * (1 - x / target):.0f}%"


def old_tail(gpus: int) -> str:
    """`tail` against sync on the old workload at `gpus` modelled GPUs, per GPU-second and to target."""
    j = load(f"emulated_budget_old_{gpus}gpu")
    t, seeds = j["speedup_vs_sync"]["tail"], j["results"]["tail"]["repeats"]
    return (f"`tail` is {budget_ratio(t, 'per_sample_gpu_s')} sync per GPU-second and its time to the target "
            f"accuracy is {budget_ratio(t, 'time_to_target_gpu_s', 'sooner')} ({seeds} seeds, bootstrap 95% "
            f"intervals), final accuracy {diff_cell(t['final_accuracy_vs_sync'])}")


def old_tail_vs_rollpacker(gpus: int) -> str:
    """`tail`'s speed per GPU-second on the old workload against RollPacker's 1.3x (its 7B/8k figure)."""
    x = load(f"emulated_budget_old_{gpus}gpu")["speedup_vs_sync"]["tail"]["per_sample_gpu_s"]
    return f"its {x:.2f}x per GPU-second " + (f"is short of RollPacker's 1.3x by {short_by(x, TAIL_TARGET)}"
                                               if x < TAIL_TARGET else "reaches RollPacker's 1.3x")


def best_to_target_shortfall(name: str) -> str:
    """How far one budget file's soonest preset to target falls short of the 1.8x aimed for, or that it clears it."""
    s = [v["time_to_target_gpu_s"] for p, v in load(name)["speedup_vs_sync"].items()
         if p != "sync" and v["time_to_target_gpu_s"] is not None]
    best = max(s)
    return (f"the soonest, {best:.2f}x, is short of the 1.8x aimed for by {short_by(best, BEST_TARGET)}"
            if best < BEST_TARGET else f"the soonest, {best:.2f}x, clears the 1.8x aimed for")


def budget_figures() -> list[str]:
    """The equal-budget reruns as the README quotes them: tail against sync on the old workload at two and four
    GPUs; the best presets on cot_sum, whose answers lengthen, at two and four GPUs."""
    return [old_tail(2), old_tail(4), *best_on_budget("emulated_budget_longcot_2gpu"),
            *best_on_budget("emulated_budget_longcot_4gpu")]


def longcot_budget_figures() -> list[str]:
    """docs/emulation.md's reading of every preset on two modelled GPUs on cot_sum, each engine running the slots
    its modelled KV holds: each preset's two ratios and final accuracy, and how far the best is from the targets."""
    j = load("emulated_budget_longcot_2gpu")
    s = {p: v for p, v in j["speedup_vs_sync"].items() if p != "sync"}
    per_gpu_s = max(s, key=lambda p: s[p]["per_sample_gpu_s"])
    reached = [p for p in s if s[p]["time_to_target_gpu_s"] is not None]
    soonest = max(reached, key=lambda p: s[p]["time_to_target_gpu_s"]) if reached else None
    out = ["; ".join(f"`{p}` {budget_ratio(v, 'per_sample_gpu_s')} per GPU-second, "
                     f"{budget_ratio(v, 'time_to_target_gpu_s', 'to target')}, final "
                     f"{diff_cell(v['final_accuracy_vs_sync'])}"
                     for p, v in s.items()),
           f"`{per_gpu_s}` is the most per GPU-second ({s[per_gpu_s]['per_sample_gpu_s']:.2f}x"]
    if soonest:
        best = s[soonest]["time_to_target_gpu_s"]
        out.append(f"`{soonest}` is the soonest to target ({best:.2f}x"
                   + (f", short of the 1.8x aimed for by {short_by(best, BEST_TARGET)}" if best < BEST_TARGET else "")
                   + ")")
    return out


def longcot32_budget_figures() -> list[str]:
    """docs/emulation.md's reading of the first run on cot_sum, at 32 slots an engine."""
    s = load("emulated_budget_longcot32_2gpu")["speedup_vs_sync"]
    tails = [-s[p]["final_accuracy_vs_sync"]["diff"] for p in ("tail", "tail-streamed", "tail-scaledown")]
    sorted_ = s["sorted"]
    return [f"`tail` is {s['tail']['per_sample_gpu_s']:.2f}x sync",
            f"end {min(tails):.3f}-{max(tails):.3f} below sync's final accuracy",
            f"{sorted_['per_sample_gpu_s']:.2f}x per GPU-second and the soonest to target, "
            f"{budget_ratio(sorted_, 'time_to_target_gpu_s')}",
            f"is {s['async']['per_sample_gpu_s']:.2f}x per GPU-second colocated and "
            f"{s['async-split']['per_sample_gpu_s']:.2f}x split",
            f"short of the 1.8x aimed for by {short_by(sorted_['time_to_target_gpu_s'], BEST_TARGET)}"]


def best_on_budget(name: str) -> list[str]:
    """The presets of one budget file that beat sync most per GPU-second and to target, with their intervals."""
    j = load(name)
    others = {p: s for p, s in j["speedup_vs_sync"].items() if p != "sync"}
    out = []
    for key, what in (("per_sample_gpu_s", "per GPU-second"), ("time_to_target_gpu_s", "sooner to target")):
        best = max((p for p in others if others[p][key] is not None), key=lambda p: others[p][key])
        s = others[best]
        out.append(f"`{best}` is {budget_ratio(s, key, what)} ({j['results'][best]['repeats']} seeds, "
                   f"final accuracy {diff_cell(s['final_accuracy_vs_sync'])})")
    short = [p for p in others if others[p]["time_to_target_gpu_s"] is None]  # a seed ended below the target
    if short:
        out.append(f"{', '.join(f'`{p}`' for p in short)} ended a seed's run below the target")
    return out


def budget_replay_figures(name: str) -> list[str]:
    """How far the simulator's replay of one file of equal-budget runs is from them: the presets' medians and the
    seeds' range of sim/live step time, and the rollout time and bubble ratio furthest off."""
    r = load(name)["results"]
    step = [v["step_time_s"] for v in r.values()]
    worst = max(r, key=lambda preset: abs(1 - r[preset]["rollout_time_s"]["sim_over_live"]))
    bubble = max(r, key=lambda preset: abs(1 - r[preset]["bubble_ratio"]["sim_over_live"]))
    return [f"step time and GPU-seconds per sample within {max(abs(1 - f['sim_over_live']) for f in step):.0%} of "
            f"the live runs' for every preset (its seeds' median; single seeds from "
            f"{min(f['sim_over_live_spread'][0] for f in step):.2f}x to "
            f"{max(f['sim_over_live_spread'][1] for f in step):.2f}x), rollout time furthest off for `{worst}` "
            f"({r[worst]['rollout_time_s']['sim_over_live']:.2f}x) and the bubble ratio for `{bubble}` "
            f"({r[bubble]['bubble_ratio']['sim_over_live']:.2f}x)"]


def emulated_comparison_figures() -> list[str]:
    """docs/emulation.md's reading of the emulated scheduler comparison and its replay by the simulator."""
    j = load("emulated_h100_7b")
    s, r = j["speedup_vs_sync"], j["results"]
    v = load("emulated_vs_sim_bench_cpu")["results"]
    off = {key: max(abs(1 - p[key]["sim_over_live"]) for p in v.values())
           for key in ("step_time_s", "rollout_time_s", "bubble_ratio")}
    accuracy_off = max(abs(x["final_accuracy_vs_sync"]["diff"]) for x in s.values())
    return [f"{s['tail']['per_sample']:.2f}x per sample, short of the 1.3x target** by "
            f"{100 * (1 - s['tail']['per_sample'] / 1.3):.0f}%",
            f"bubble from {r['sync']['bubble_ratio']:.2f} to {r['tail']['bubble_ratio']:.2f}",
            f"**{s['tail-streamed']['per_sample']:.2f}x sync's",
            f"is {s['async-eta2']['time_to_target']:.2f}x sooner, short of 2x** by "
            f"{100 * (1 - s['async-eta2']['time_to_target'] / 2):.0f}%",
            f"`tail-streamed` {s['tail-streamed']['time_to_target']:.2f}x, `async` {s['async']['time_to_target']:.2f}x, "
            f"`tail` {s['tail']['time_to_target']:.2f}x",
            f"{s['sorted']['time_to_target']:.2f}x and {s['sorted-partial']['time_to_target']:.2f}x",
            f"Measured again: {s['tail-streamed']['per_sample']:.2f}x sync per sample and "
            f"{s['tail-streamed']['time_to_target']:.2f}x sooner to the target",
            f"every final accuracy is within {accuracy_off:.3f} of sync's",
            "Step time is within {step_time_s:.0%}, rollout time within {rollout_time_s:.0%} and bubble ratio "
            "within {bubble_ratio:.0%} for every preset".format(**off)]


ABORTING = ("tail", "tail-streamed", "tail-scaledown", "sorted", "sorted-partial")  # presets whose rounds end in aborts


def abort_landing_figures() -> list[str]:
    """The simulator's replay of the old workload at four modelled GPUs before aborts landed inside a paced step
    (docs/design.md "Emulated clock") and after, for the presets measured again: each one's sim/live step time."""
    before, after = (load(f"emulated_budget_vs_sim_old_4gpu{s}")["results"] for s in ("_waited", ""))
    return ["; ".join(f"`{p}` {before[p]['step_time_s']['sim_over_live']:.2f}x before, "
                      f"{after[p]['step_time_s']['sim_over_live']:.2f}x after" for p in ABORTING)]


def starting_model_figures() -> list[str]:
    """The model cot_sum's two budget files started from (their sync runs' step-0 accuracy: one for both) against
    the first measurement's, which the 32-slot file keeps; and the tiny model built again on one machine under its
    own CPU kernels and under AVX2's: one config, other weights."""
    starts = {load(f"emulated_budget_longcot_{b}gpu")["runs"]["sync"][0]["initial_accuracy"] for b in (2, 4)}
    assert len(starts) == 1, f"cot_sum's two budget files started from other models: step-0 accuracy {starts}"
    (start,) = starts
    first = load("emulated_budget_longcot32_2gpu")["runs"]["sync"][0]["initial_accuracy"]
    builds = load("warm_start_cpu_kernels_cpu")["builds"]
    own = [b for b in builds if b["kernels"] == "default"]
    other = next(b for b in builds if b["kernels"] != "default")
    same = "bit for bit the same" if len({b["fingerprint"] for b in own}) == 1 else "different each time"
    return [f"step-0 accuracy {start:.3f} against {first:.3f}",
            f"built {len(own)} times with its own kernels ({own[0]['capability']}) the model came out {same} "
            f"(fingerprint {own[0]['fingerprint']}, greedy exact match {own[0]['eval_greedy_accuracy']:.3f}); with "
            f"{other['capability']}'s, other weights ({other['fingerprint']}, {other['eval_greedy_accuracy']:.3f})"]


def prose_figures() -> dict[str, list[str]]:
    """Figures quoted in prose, as each document must spell them: a changed file or a changed digit fails."""
    s, speed = load("bench_schedulers_cpu")["results"], load("bench_schedulers_cpu")["speedup_vs_sync"]
    load_cpu = load("controller_load_cpu")["results"]
    rate = [f"{r['events_per_s'] / 1000:.0f}k" for r in load_cpu.values()]
    bf16 = load("mismatch_bf16_cpu")["results"]["bf16-tis"]
    run = load("default_run_cpu")
    overlap = load("bench_async_cpu")["speedup_vs_sync"]
    sim = sim_figures()
    plain, fast = overlap["async"], overlap["async-loglinear"]
    eta2 = overlap["async-eta2"]["per_sample"]
    return {
        "README.md": [f"lifts the default task by {100 * (run['evals'][-1]['eval/accuracy'] - run['evals'][0]['eval/accuracy']):.0f} points",
                      f"load average {run['machine']['load_average_at_start']:.1f} at its start"],
        "docs/schedulers.md": [
            *(sim[k] for k in ("in_sample", "held_out", "one_out", "range", "centre", "runaway", "mfu", "lengths",
                               "overhead", "unvalidated", "anchors")),
            *budget_figures(),
            starting_model_figures()[0],
            "streamed `tail` {streamed:.2f}x and `async` with eta 2 {eta2:.2f}x sooner".format(**emulated_speeds()),
            f"trained {fast['per_sample']:.2f}x faster per sample than `sync` and reached the "
            f"target {fast['time_to_target']:.2f}x sooner",
            f"recomputed it was {plain['per_sample']:.2f}x",
            f"is missed by {100 * (1 - fast['per_sample'] / 1.4):.0f}%",
            "the engine the train step runs {:.0f}% longer".format(*async_profile_shares()),
            "published, the next step launched), {:.0f}% of each step".format(async_profile_shares()[1]),
            f"wastes nothing ({fast['per_sample']:.2f}x per sample",
            f"{s['sorted']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's bubble",
            f"{s['tail']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's bubble",
            f"this CPU ({speed['sorted']['per_sample']:.2f}x to {speed['sagc']['per_sample']:.2f}x"],
        "docs/tools.md": tool_guess_figures(),
        "docs/algorithms.md": [f"mismatch KL of {bf16['mismatch_kl_mean']:.0e} per token"],
        "docs/emulation.md": [
            *emulated_vs_sim_figures(),
            *emulated_comparison_figures(),
            *(f for name in BUDGET_REPLAYS for f in budget_replay_figures(name)),
            *abort_landing_figures(),
            *starting_model_figures(),
            *longcot_budget_figures(),
            *best_on_budget("emulated_budget_old_2gpu"),
            *(f for gpus in (2, 4) for f in (old_tail(gpus), old_tail_vs_rollpacker(gpus))),
            *best_on_budget("emulated_budget_old_4gpu"), best_to_target_shortfall("emulated_budget_old_4gpu"),
            *four_gpu_figures(),
            *longcot32_budget_figures(),
            *emulated_sagc_figures()],
        "docs/performance.md": [
            *sim.values(),
            *loss_sweep_figures(),
            f"zero or upward in every draw ({dg_net('dg')}; PPO's {dg_net('ppo')})",
            *async_profile_figures(),
            *tool_arith_figures(),
            *tool_guess_figures(),
            tool_guess_peaks(),
            lift_figures("tool_guess_lift_cap200_cpu"),
            f"reaches the target {fast['time_to_target']:.2f}x sooner with final accuracy within the error, but is "
            f"{fast['per_sample']:.2f}x per sample, {100 * (1 - fast['per_sample'] / 1.4):.0f}% short",
            f"is {plain['per_sample']:.2f}x per sample, {100 * (1 - plain['per_sample'] / 1.4):.0f}% short, and "
            f"{plain['time_to_target']:.2f}x sooner; eta 2 adds nothing to eta 1 ({eta2:.2f}x)",
            f"stays near {bf16['mismatch_kl_mean']:.0e}",
            f"cuts the bubble to {s['sorted']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's",
            "Per sample it is {:.2f}x sync, with pairs from {:.2f}x to {:.2f}x".format(
                speed["tail"]["per_sample"], *speed["tail"]["per_sample_spread"]),
            f"Per sample it is {speed['sagc']['per_sample']:.2f}x sync: the larger group",
            f"straggler rates on this task stay near {s['sagc-tight']['straggler_rate']:.2f}",
            f"{min(rate, key=lambda x: int(x[:-1]))} to {max(rate, key=lambda x: int(x[:-1]))} completion events"],
    }


# --- the documents ------------------------------------------------------------------------------------
def render(text: str) -> str:
    """`text` with every marked table rendered from its results file."""
    def fill(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise KeyError(f"table {m.group(2)!r} has no renderer in benchmarks/readme_tables.py")
        return m.group(1) + "\n" + TABLES[m.group(2)]() + "\n" + m.group(4)
    return MARKED.sub(fill, text)


def marked_names(text: str) -> list[str]:
    return [m.group(2) for m in MARKED.finditer(text)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the stale tables in place")
    args = p.parse_args()
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        if render(text) != text:
            stale.append(doc.relative_to(ROOT))
            if args.write:
                doc.write_text(render(text))
    verb = "rewrote" if args.write else "stale (run with --write)"
    for doc in stale:
        print(f"{verb}: {doc}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
