"""Tables and prose figures of live CPU runs (`rlsys bench`, `make train`, the loss, tool and overlap studies), the
engine's and the controller's micro-benchmarks, and the GPU runs' files."""
from __future__ import annotations

import statistics
from functools import partial

from doc_tables import ROOT, acc_se, diff_cell, load, num, ratio_cell, rows, spread, table, versus_sync


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


@table("algorithms_round4")
def algorithms_round4() -> str:
    """Issue 67's features beside dapo (benchmarks/losses_round2.py): the mean final avg@1 ± its error, each seed's
    difference to dapo's with its paired t 95% interval, the median step time and dapo's over it with its interval."""
    r = load("algorithms_round4_cpu")["results"]
    body = []
    for name, cell in r.items():
        d, ratio = cell.get("final_accuracy_vs_dapo"), cell.get("step_time_dapo_over_this")
        vs = "" if d is None else f"{d['diff']:+.3f}" + (" [{:+.3f}, {:+.3f}]".format(*d["ci95"]) if d["ci95"] else "")
        interval = cell.get("step_time_dapo_over_this_ci95")
        speed = "" if ratio is None else ratio_cell(ratio, interval) if interval else f"{ratio:.2f}x"
        body.append([f"`{name}`", acc_se(cell), vs, num(statistics.median(x["step_time_s"] for x in cell["runs"])),
                     speed, cell["n"]])
    start = r["dapo"]["runs"][0]["initial_accuracy"]
    return rows([f"run (avg@1 at step 0: {start:.3f})", "final avg@1", "minus dapo, by seed [95% t]", "step s",
                 "dapo's step s / this [95% t]", "seeds"], body)


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


def algorithms_round4_figures() -> list[str]:
    """Each feature's final avg@1 minus dapo's with its paired t 95% interval, as docs/design.md quotes them."""
    r = load("algorithms_round4_cpu")["results"]
    return ["{diff:+.3f} [{0:+.3f}, {1:+.3f}]".format(*r[name]["final_accuracy_vs_dapo"]["ci95"],
                                                     **r[name]["final_accuracy_vs_dapo"])
            for name in r if name != "dapo"]


def tool_guess_turns_figures() -> list[str]:
    """The task where RL must learn the turns, as docs/tools.md quotes it: the 30-step run, then each preset's
    longer runs (medians over seeds, but the final accuracy: their mean with its error), then one without the
    per-turn shaping beside the same seed with it."""
    def halfway(run: dict) -> float:  # the eval at the run's middle step
        return run["eval_curve"][len(run["eval_curve"]) // 2][1]

    def said(r: dict, runs: list[dict]) -> str:
        gain, se = lift(r)
        shaped = [(run["tool_calls_first"] * run["turn_reward_first"], run["tool_calls_last"] * run["turn_reward_last"])
                  for run in runs]  # calls per sample x reward per call: the turn rewards of a sample
        first, last = (statistics.median(pair[i] for pair in shaped) for i in (0, 1))
        return (f"{r['final_accuracy']:.3f} ± {r['final_accuracy_se']:.3f} ({gain / se:.1f} times the lift's error), "
                f"{r['tool_calls_first']:.2f} -> {r['tool_calls_last']:.2f} calls per sample, turn rewards "
                f"{first:.3f} -> {last:.3f} a sample")
    short = load("tool_guess_turns2_cpu")
    r, runs = short["results"]["sync"], short["runs"]["sync"]
    figures = [f"avg@1 {r['initial_accuracy']:.3f} ± {r['initial_accuracy_se']:.3f} -> {said(r, runs)}"]
    j = load("tool_guess_turns2_60_cpu")
    steps = j["workload"]["total_steps"]
    for preset, runs in j["runs"].items():
        middle = "/".join(f"{halfway(run):.3f}" for run in runs)
        figures.append(f"`{preset}`, {len(runs)} seed{'s' * (len(runs) > 1)}: {middle} at step {steps // 2}, "
                       f"{said(j['results'][preset], runs)} at step {steps}")
    run, shaped = load("tool_guess_turns2_unshaped_cpu")["runs"]["sync"][0], j["runs"]["sync"][0]  # seed 0 of each
    figures.append(f"avg@1 {halfway(run):.3f} and {run['final_accuracy']:.3f} ± {run['final_accuracy_se']:.3f} at "
                   f"steps {steps // 2} and {steps} (with the shaping, the same seed: {halfway(shaped):.3f} and "
                   f"{shaped['final_accuracy']:.3f}), {run['tool_calls_first']:.2f} -> {run['tool_calls_last']:.2f} "
                   "calls per sample")
    return figures
