"""`rlsys bench` figures from metrics rows: per-run summaries, equal-time accuracy, medians with spreads."""
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from rlsys.bench import WARMUP_STEPS, Target, add_equal_time, aggregate, changing_nothing, summarise_run
from rlsys.cli import build_parser
from rlsys.startup import load_config

REPO = Path(__file__).resolve().parent.parent


STEP = {"samples": 128, "rollout/bubble_ratio": 0.2, "rollout/straggler_rate": 0.1, "rollout/efficiency": 0.8,
        "throughput/tokens_per_s": 100.0, "response_length/mean": 8.0, "group_size": 8}  # a step row's figures


def rows(step_s, evals, samples=128):
    """A run's metrics rows: steps of `step_s` seconds, evals as (time, accuracy)."""
    out = [{"time_s": t, "eval/accuracy": acc} for t, acc in evals]
    for i in range(1, 5):
        out.append({**STEP, "time_s": i * step_s, "timing/step_s": step_s, "samples": samples})
    return sorted(out, key=lambda r: r["time_s"])


def test_equal_time_takes_each_runs_last_eval_before_the_shortest_run_ends():
    fast = summarise_run(rows(1.0, [(0, 0.2), (2, 0.3), (4, 0.35)]), target=0.3)
    slow = summarise_run(rows(2.0, [(0, 0.2), (3, 0.25), (8, 0.4)]), target=0.3)
    # crossed at an eval (fast), or between two: interpolated, 0.3 a third of the way from 0.25 at 3 s to 0.4 at 8 s
    assert fast["time_to_target_s"] == 2 and slow["time_to_target_s"] == pytest.approx(3 + 5 / 3)
    assert fast["time_per_sample_s"] == pytest.approx(4.0 / 512)
    t = add_equal_time({"fast": [fast], "slow": [slow]})
    assert t == 4.0
    assert fast["accuracy_at_equal_time"] == 0.35 and slow["accuracy_at_equal_time"] == 0.25
    assert slow["final_accuracy"] == 0.4  # at equal samples the slow run is ahead


def test_a_run_with_tools_reports_its_calls_and_turn_reward_at_the_first_and_last_step_and_its_first_evals_error():
    run = rows(1.0, [(0, 0.2), (4, 0.35)])
    run[0]["eval/accuracy_se"] = 0.02
    steps = [r for r in run if "timing/step_s" in r]
    for r, turns in zip(steps, (0.5, 0.7, 0.9, 1.0)):
        r["rollout/turns"], r["rollout/turn_reward"] = turns, turns / 10
    out = summarise_run(run, target=0.3)
    assert (out["tool_calls_first"], out["tool_calls_last"], out["initial_accuracy_se"]) == (0.5, 1.0, 0.02)
    assert (out["turn_reward_first"], out["turn_reward_last"]) == (0.05, 0.1)
    assert "tool_calls_first" not in summarise_run(rows(1.0, [(0, 0.2)]), target=0.3)


def test_aggregate_reports_the_median_and_spread_and_no_time_to_target_unless_every_repeat_reached_it():
    a = summarise_run(rows(1.0, [(0, 0.2), (4, 0.35)]), target=0.3)
    b = summarise_run(rows(1.5, [(0, 0.2), (6, 0.25)]), target=0.3)
    out = aggregate([a, b])
    assert out["step_time_s"] == pytest.approx(1.25) and out["step_time_s_spread"] == [1.0, 1.5]
    assert out["time_to_target_s"] is None
    assert "eval_curve" not in out
    stopped = {k: v for k, v in a.items() if k != "overrun_share"}  # a run stopped before its final row
    assert aggregate([dict(b, overrun_share=0.01), stopped])["overrun_share"] == 0.01


def test_aggregate_keeps_a_label_whole_over_an_even_count_of_repeats():
    """The model's fingerprint has no median: two repeats of one start give it once, of two starts give both."""
    a = dict(summarise_run(rows(1.0, [(0, 0.2), (4, 0.35)]), target=0.3), model_fingerprint="a" * 16)
    assert aggregate([a, a])["model_fingerprint"] == "a" * 16 and "model_fingerprint_spread" not in aggregate([a, a])
    assert aggregate([a, dict(a, model_fingerprint="b" * 16)])["model_fingerprint"] == ["a" * 16, "b" * 16]
    assert aggregate([a, dict(a, model_fingerprint=None)])["model_fingerprint"] == "a" * 16


def test_speed_up_is_the_geometric_mean_of_each_repeats_pair_not_a_ratio_of_medians():
    """Repeat 1 ran on a quieter machine for both presets: its pair still reads 1.25x, while the medians of
    each preset alone (sync 4.0, other 3.5 ms) would mix repeats and read 1.14x."""
    from rlsys.bench import speedups

    def run(ms, to_target):
        return {"time_per_sample_s": ms / 1000, "time_to_target_s": to_target, "final_accuracy": 0.3,
                "final_accuracy_se": 0.01}

    runs = {"sync": [run(4.0, 40), run(2.5, 25), run(5.0, 50)],
            "other": [run(3.5, 30), run(2.0, None), run(4.0, 40)]}
    out = speedups(runs, {name: aggregate(rs) for name, rs in runs.items()})["other"]
    assert out["per_sample"] == pytest.approx((4 / 3.5 * 1.25 * 1.25) ** (1 / 3)) and out["per_sample_spread"] == pytest.approx([1.1429, 1.25], abs=1e-4)
    assert out["time_to_target"] is None and out["time_to_target_spread"] is None  # one repeat never reached it
    assert out["final_accuracy_vs_sync"]["diff"] == 0


def test_repeats_final_accuracy_is_their_mean_with_an_error_from_the_spread_or_the_evals_whichever_is_larger():
    def run(acc, se=0.01):
        return {**summarise_run(rows(1.0, [(0, 0.1), (4, acc)]), target=0.3), "final_accuracy_se": se}

    spread = aggregate([run(0.20), run(0.30), run(0.25)])
    assert spread["final_accuracy"] == pytest.approx(0.25) and spread["final_accuracy_spread"] == [0.20, 0.30]
    assert spread["final_accuracy_se"] == pytest.approx(0.05 / 3 ** 0.5)  # stdev 0.05 over sqrt(3)
    alike = aggregate([run(0.25), run(0.25), run(0.25)])
    assert alike["final_accuracy_se"] == pytest.approx(0.01)  # identical runs: one eval's error, not divided by 3
    mixed = aggregate([run(0.25, se=0.01), run(0.26, se=0.02)])
    assert mixed["final_accuracy_se"] == pytest.approx(((0.01 ** 2 + 0.02 ** 2) / 2) ** 0.5)  # rms of the two


def test_an_accuracy_difference_counts_only_beyond_two_standard_errors():
    from rlsys.bench import accuracy_difference, cell

    sync = {"final_accuracy": 0.30, "final_accuracy_se": 0.01}
    close = {"final_accuracy": 0.32, "final_accuracy_se": 0.01}  # 0.02 apart, se of the difference 0.014
    far = {"final_accuracy": 0.34, "final_accuracy_se": 0.01}
    assert accuracy_difference(close, sync) == pytest.approx({"diff": 0.02, "se": 2 ** 0.5 * 0.01,
                                                              "beyond_error": False})
    assert accuracy_difference(far, sync)["beyond_error"]
    assert accuracy_difference({"final_accuracy": None}, sync) is None
    assert cell(close, "final_accuracy", "{:.3f}") == "0.320±0.010"
    assert cell({"step_time_s": 0.5}, "step_time_s", "{:.2f}") == "0.50"


def test_a_target_gain_counts_from_each_runs_first_eval():
    target = Target.parse("+0.05")
    low = summarise_run(rows(1.0, [(0, 0.1), (2, 0.16), (4, 0.3)]), target)
    high = summarise_run(rows(1.0, [(0, 0.3), (2, 0.34), (4, 0.36)]), target)
    assert (low["target_accuracy"], low["time_to_target_s"]) == (pytest.approx(0.15), pytest.approx(2 * 5 / 6))
    assert (high["target_accuracy"], high["time_to_target_s"]) == (pytest.approx(0.35), pytest.approx(3))
    assert summarise_run(rows(1.0, [(0, 0.1), (2, 0.16)]), Target.parse("0.15"))["time_to_target_s"] == \
        pytest.approx(2 * 5 / 6)


def test_the_default_target_is_one_the_default_run_reaches():
    """The stored `make train` run (benchmarks/results/default_run_cpu.json): avg@4 0.275 -> ~0.34."""
    run = json.loads((REPO / "benchmarks" / "results" / "default_run_cpu.json").read_text())
    evals = [{"time_s": e["time_s"], "eval/accuracy": e["eval/accuracy"]} for e in run["evals"]]
    args = build_parser().parse_args(["bench"])
    assert summarise_run(evals, args.target)["time_to_target_s"] is not None


def test_a_target_that_is_not_a_number_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--target", "half"])
    assert "argument --target: 'half' is not an accuracy (0.3) or a gain" in capsys.readouterr().err


def test_two_presets_joined_by_plus_combine_and_an_unknown_one_is_named():
    from rlsys.bench import PRESETS, available, preset_overrides
    from rlsys.errors import UserError

    assert preset_overrides("sorted+G4") == PRESETS["sorted"] + PRESETS["G4"]
    assert preset_overrides("async+sagc") == PRESETS["async+sagc"]  # a preset of its own wins over the join
    assert available("sorted+sagc")
    with pytest.raises(UserError, match=r"--presets: unknown preset 'G5' in 'sorted\+G5'"):
        preset_overrides("sorted+G5")


def test_top_up_keeps_the_other_presets_runs_of_the_same_workload_only(tmp_path):
    from rlsys.bench import kept_runs
    from rlsys.errors import UserError

    workload = {"config": "configs/tiny.yaml", "overrides": ["trainer.total_steps=4"], "target": "+0.03"}
    cfg = load_config(None, [f"model.cache_dir={tmp_path / 'cache'}", "model.warm_start.steps=0"])
    output = tmp_path / "report.json"
    assert kept_runs(str(output), workload, ["sync"], cfg) == {}  # nothing measured yet
    output.write_text(json.dumps({"workload": dict(workload, target_accuracy=0.2),
                                  "runs": {"sync": [{"wall_s": 1.0}], "tail": [{"wall_s": 2.0}]}}))
    assert kept_runs(str(output), workload, ["sync", "async"], cfg) == {"tail": [{"wall_s": 2.0}]}  # sync run again
    with pytest.raises(UserError, match=r"--top-up: .* another workload \(overrides: \['trainer.total_steps=4'\]\)"):
        kept_runs(str(output), dict(workload, overrides=["trainer.total_steps=8"]), ["async"], cfg)
    # measured from another machine's model: not topped up here
    output.write_text(json.dumps({"workload": dict(workload, target_accuracy=0.2),
                                  "runs": {"tail": [{"wall_s": 2.0, "model_fingerprint": "0" * 16}]}}))
    with pytest.raises(UserError, match=r"--top-up: .*report.json: its runs started from the model 0{16}"):
        kept_runs(str(output), workload, ["sync"], cfg)


def test_a_preset_that_changes_nothing_on_the_workload_is_skipped_as_the_baseline_again():
    default = load_config(None, [])  # the default task has no tools
    assert changing_nothing(default, None, [], ["sync", "tail", "no-tools"]) == ["no-tools"]
    tools = "configs/tool_arith.yaml"
    assert changing_nothing(load_config(tools, []), tools, [], ["sync", "no-tools"]) == []


def test_every_run_reports_gpu_seconds_and_a_comparison_across_gpu_budgets_is_marked(capsys):
    """Two presets on different GPU budgets: the wall-time speedup is flagged, the GPU-second one is beside it."""
    from rlsys.bench import print_table, speedups

    sync = [summarise_run(rows(1.0, [(0, 0.2), (4, 0.35)]), target=0.3, gpus=2) for _ in range(3)]
    more = [summarise_run(rows(0.5, [(0, 0.2), (2, 0.35)]), target=0.3, gpus=4) for _ in range(3)]
    assert sync[0]["gpu_s_per_sample"] == pytest.approx(2 * 4.0 / 512) and more[0]["gpus"] == 4
    assert sync[0]["gpu_s_to_target"] == pytest.approx(2 * sync[0]["time_to_target_s"])
    runs = {"sync": sync, "more": more}
    results = {name: aggregate(rs) for name, rs in runs.items()}
    out = speedups(runs, results)
    assert out["more"]["per_sample"] == pytest.approx(2.0) and out["more"]["per_sample_gpu_s"] == pytest.approx(1.0)
    assert out["more"]["budgets_differ"] and not out["sync"]["budgets_differ"]
    assert out["more"]["gpus_sync_and_this"] == [2, 4]
    print_table({"workload": {}, "results": results, "speedup_vs_sync": out, "equal_time_s": None})
    lines = capsys.readouterr().out.splitlines()
    more_line = next(line for line in lines if line.startswith("more"))
    assert "2.00x *" in more_line and "1.00x" in more_line  # marked, and its GPU-second ratio beside it
    assert "*" not in next(line for line in lines if line.startswith("sync"))
    assert any(line.startswith("* on a different GPU budget") for line in lines)


def test_a_run_reports_its_length_shape_at_the_first_and_the_last_step():
    run = rows(1.0, [(0, 0.2), (4, 0.35)])
    steps = [r for r in run if "timing/step_s" in r]
    for r, (p50, at_cap) in zip(steps, ((6, 0.0), (7, 0.01), (8, 0.02), (12, 0.05))):
        r.update({"response_length/p50": p50, "response_length/p90": 3 * p50, "response_length/p99": 9 * p50,
                  "response_length/at_cap": at_cap})
    out = summarise_run(run, target=0.3)
    assert (out["length_p50_first"], out["length_p90_first"], out["length_p99_first"]) == (6, 18, 54)
    assert (out["length_p50_last"], out["length_at_cap_last"], out["length_at_cap_first"]) == (12, 0.05, 0.0)
    assert aggregate([out, out])["length_p50_last"] == 12
    assert "length_p50_first" not in summarise_run(rows(1.0, [(0, 0.2)]), target=0.3)  # a run that did not log it


def sorted_rows(round_steps: list[int], step_s: list[float], last_round_whole: bool = True) -> list[dict]:
    """A sorted run's step rows: rounds of `round_steps` updates each, the step times given in order; its
    last round cut short by the run's end unless `last_round_whole`."""
    out, i = [], 0
    for number, n in enumerate(round_steps, start=1):
        for k in range(n):
            done = k == n - 1 and (number < len(round_steps) or last_round_whole)
            out.append({**STEP, "time_s": sum(step_s[:i + 1]), "timing/step_s": step_s[i],
                        "sorted/round": number, "sorted/deferred_prompts": 0 if done else 4 * (n - k)})
            i += 1
    return out


def test_sorted_step_time_is_whole_rounds_after_the_warm_up_over_their_steps():
    # short groups train first: each round's updates grow slower (1, 2, 3, 6 s); the third round is cut at the end
    times = [9.0, 9.0, 9.0, 9.0] + [1.0, 2.0, 3.0, 6.0] + [1.0, 2.0, 3.0, 6.0] + [1.0, 2.0]
    out = summarise_run(sorted_rows([4, 4, 4, 2], times, last_round_whole=False), target=0.3)
    assert WARMUP_STEPS <= 4  # the first round holds the warm-up: rounds two and three are timed
    assert out["step_time_s"] == pytest.approx(sum(times[4:12]) / 8)  # not the cut round's fast half
    whole = summarise_run(sorted_rows([4, 4, 4, 2], times, last_round_whole=True), target=0.3)
    assert whole["step_time_s"] == pytest.approx(sum(times[4:14]) / 10)  # a last round that ended counts
    # a round ends where the next begins even if a prompt was left to drop: the round number says so
    rows_ = sorted_rows([4, 4, 4, 2], times, last_round_whole=False)
    rows_[7]["sorted/deferred_prompts"] = 1
    assert summarise_run(rows_, target=0.3)["step_time_s"] == pytest.approx(sum(times[4:12]) / 8)
    # one round, still going: no whole round to time, so the steps after the warm-up
    partial = summarise_run(sorted_rows([6], [1.0, 2.0, 3.0, 6.0, 1.0, 2.0], last_round_whole=False), target=0.3)
    assert partial["step_time_s"] == pytest.approx((3.0 + 6.0 + 1.0 + 2.0) / 4)
    # a run of one whole round that starts within the warm-up: the round from its start
    assert summarise_run(sorted_rows([4], [5.0, 1.0, 2.0, 4.0]), target=0.3)["step_time_s"] == pytest.approx(3.0)
    # other schedulers: the steps after the warm-up
    assert summarise_run(rows(1.0, [(0, 0.2)]), target=0.3)["step_time_s"] == pytest.approx(1.0)


def dense(step_s, accs, gpus=2, seed=0, samples=128, length=8.0):
    """A run's summary from metrics rows as the controller logs them: an eval at step 0 and in every step's row."""
    out = [{"step": 0, "time_s": 0.0, "eval/accuracy": accs[0]}]
    out += [{**STEP, "step": i, "time_s": i * step_s, "timing/step_s": step_s, "samples": samples,
             "response_length/mean": length, "eval/accuracy": acc} for i, acc in enumerate(accs[1:], start=1)]
    return {**summarise_run(out, target=1.0, gpus=gpus), "seed": seed}


def test_targets_are_set_from_syncs_own_gain_and_final_accuracy():
    from rlsys.bench import repeated_accuracy, sync_targets

    sync = [dense(1.0, [0.40, 0.45, 0.52, 0.56], seed=0), dense(1.0, [0.40, 0.50, 0.55, 0.60], seed=1),
            dense(1.0, [0.40, 0.44, 0.50, 0.52], seed=2)]  # gains 0.16, 0.20, 0.12: median 0.16
    targets = sync_targets(sync)
    assert targets["gain_25"] == pytest.approx(0.44) and targets["gain_50"] == pytest.approx(0.48)
    assert targets["gain_75"] == pytest.approx(0.52)
    mean, se = repeated_accuracy(sync)
    assert mean == pytest.approx(0.56) and targets["final_less_se"] == pytest.approx(0.56 - se)
    assert se == pytest.approx(0.04 / 3 ** 0.5)  # finals 0.56, 0.60, 0.52: stdev 0.04 over sqrt(3), no eval se
    flat = sync_targets([dense(1.0, [0.40, 0.39, 0.40, 0.38])])
    assert flat["gain_25"] is None and flat["final_less_se"] is None  # sync gained nothing: reached at step 0
    # a gain within one eval's error: 0.41 - 0.02 is below the start
    small = sync_targets([{**dense(1.0, [0.40, 0.41], seed=s), "final_accuracy_se": 0.02} for s in range(3)])
    assert small["gain_50"] == pytest.approx(0.405) and small["final_less_se"] is None


def test_gpu_seconds_and_samples_to_each_target_cross_between_dense_evals():
    from rlsys.bench import add_targets

    sync = [dense(1.0, [0.40, 0.44, 0.48, 0.52, 0.56])]  # gain 0.16: targets 0.44, 0.48, 0.52 and 0.56
    fast = [dense(0.5, [0.40, 0.42, 0.50, 0.54, 0.55])]  # never reaches sync's final 0.56
    targets = add_targets({"sync": sync, "fast": fast})
    assert sync[0]["gpu_s_to_gain_25"] == pytest.approx(2.0) and sync[0]["gpu_s_to_final_less_se"] == pytest.approx(8)
    # 0.44: a quarter of the way from 0.42 (step 1: 0.5 s, 128 samples) to 0.50 (step 2: 1 s, 256 samples)
    assert fast[0]["gpu_s_to_gain_25"] == pytest.approx(2 * 0.625)
    assert fast[0]["samples_to_gain_25"] == pytest.approx(160)
    # 0.52: half way from 0.50 (step 2) to 0.54 (step 3: 1.5 s, 384 samples)
    assert fast[0]["gpu_s_to_gain_75"] == pytest.approx(2 * 1.25)
    assert fast[0]["samples_to_gain_75"] == pytest.approx(320)
    assert fast[0]["gpu_s_to_final_less_se"] is None and fast[0]["samples_to_final_less_se"] is None
    assert targets["final_less_se"] == pytest.approx(0.56)  # one seed, no eval error logged


def test_accuracy_at_equal_gpu_seconds_is_at_the_gpu_seconds_syncs_run_of_the_same_seed_used():
    from rlsys.bench import add_targets, speedups

    sync = [dense(1.0, [0.40, 0.44, 0.48, 0.52, 0.56], seed=s) for s in (0, 1)]  # 4 s on 2 GPUs: 8 GPU-s
    wide = [dense(0.5, [0.40, 0.45, 0.50, 0.60, 0.62], gpus=4, seed=0),  # 8 GPU-s: its step-4 eval (0.62)
            dense(0.6, [0.40, 0.45, 0.50, 0.55, 0.60], gpus=4, seed=1)]  # at 8 GPU-s its step 3 (7.2 GPU-s)
    runs = {"sync": sync, "wide": wide}
    targets = add_targets(runs)
    assert [r["accuracy_at_sync_gpu_s"] for r in wide] == [0.62, 0.55]
    out = speedups(runs, {n: aggregate(v) for n, v in runs.items()}, targets)["wide"]
    assert out["accuracy_at_sync_gpu_s"]["diff"] == pytest.approx(((0.62 - 0.56) + (0.55 - 0.56)) / 2)
    half = 12.706 * statistics.stdev([0.06, -0.01]) / 2 ** 0.5  # t's 97.5% quantile at one degree of freedom
    assert out["accuracy_at_sync_gpu_s"]["ci95"] == pytest.approx([0.025 - half, 0.025 + half])


def test_pairs_are_matched_by_seed_when_a_preset_ran_fewer_seeds_than_sync():
    from rlsys.bench import pair_ratios

    sync = [{"seed": s, "x": float(s + 1)} for s in range(8)]
    other = [{"seed": 5, "x": 3.0}, {"seed": 2, "x": 1.5}]
    assert pair_ratios(sync, other, "x") == [2.0, 2.0]  # seed 5's sync (6.0) and seed 2's (3.0), not the first two


def test_a_ratios_interval_is_a_paired_t_interval_on_the_logs():
    """By hand: ratios 1, 1, 1, 2, 2 have logs of mean 0.27726 and standard deviation 0.37965; t(4) = 2.776, so
    the interval is exp(0.27726 ± 2.776 x 0.37965 / sqrt(5)) = [0.8236, 2.1140]. The pairs split in two: their mean
    is uncertain beyond their min and max, which a percentile bootstrap would give at most."""
    from rlsys.bench import ratio_interval, t975

    mean, interval = ratio_interval([1.0, 1.0, 1.0, 2.0, 2.0])
    assert mean == pytest.approx(2 ** 0.4) and interval == pytest.approx([0.8236, 2.1140], abs=2e-4)
    assert interval[0] < 1.0 and interval[1] > 2.0  # wider than the pairs' min and max
    _, alike = ratio_interval([1.5, 1.5, 1.5])
    assert alike == pytest.approx([1.5, 1.5])
    assert ratio_interval([1.3]) == (pytest.approx(1.3), None)  # one pair: no interval
    assert t975(4) == 2.776 and t975(40) == pytest.approx(2.021, abs=1e-3)  # past the table: Cornish-Fisher's
    assert t975(1000) == pytest.approx(1.962, abs=1e-3)


def test_the_t_interval_covers_the_true_ratio_95_percent_of_the_time_where_min_max_covers_less():
    """5 and 3 seeds of log-normal ratios around 1.3x: the t interval holds 1.3 in 95% of draws; the pairs'
    [min, max] (the widest a percentile bootstrap gives) in 1 - 2 x 0.5^n: 94% and 75%."""
    from rlsys.bench import ratio_interval

    rng = random.Random(0)
    for n, min_max_cover in ((5, 0.9375), (3, 0.75)):
        draws = [[1.3 * math.exp(rng.gauss(0, 0.2)) for _ in range(n)] for _ in range(20000)]
        t_cover = statistics.fmean(lo <= 1.3 <= hi for lo, hi in (ratio_interval(d)[1] for d in draws))
        spread_cover = statistics.fmean(min(d) <= 1.3 <= max(d) for d in draws)
        assert t_cover == pytest.approx(0.95, abs=0.005)
        assert spread_cover == pytest.approx(min_max_cover, abs=0.01) and spread_cover < t_cover - 0.005


def per_sample_without_length(report: dict) -> list[str]:
    """The presets whose per-sample ratios to sync stand without the per-token ratio and both trained lengths."""
    bare = []
    for name, versus in report["speedup_vs_sync"].items():
        for key in (k for k, v in versus.items() if k.startswith("per_sample") and v is not None):
            beside = versus.get(key.replace("per_sample", "per_token"))
            lengths = versus.get("trained_length_sync_and_this") or [None]
            if beside is None or None in lengths:
                bare.append(f"{name}: {key}")
    return bare


def test_no_report_gives_a_per_sample_ratio_without_the_trained_length_and_the_per_token_ratio_beside_it(capsys):
    from rlsys.bench import add_targets, print_table, speedups

    runs = {"sync": [dense(1.0, [0.40, 0.45, 0.50], seed=s, length=8.0) for s in range(3)],
            "long": [dense(1.5, [0.40, 0.46, 0.52], seed=s, length=16.0) for s in range(3)]}
    targets = add_targets(runs)
    results = {n: aggregate(v) for n, v in runs.items()}
    report = {"workload": {}, "results": results, "speedup_vs_sync": speedups(runs, results, targets),
              "targets": targets, "equal_time_s": None}
    assert per_sample_without_length(report) == []
    long = report["speedup_vs_sync"]["long"]
    # 1.5x slower per sample, but its samples are twice as long: 1.33x faster per trained token
    assert long["per_sample_gpu_s"] == pytest.approx(1 / 1.5) and long["per_token_gpu_s"] == pytest.approx(2 / 1.5)
    assert long["trained_length_sync_and_this"] == [8.0, 16.0]
    print_table(report)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("long "))
    assert "0.67x" in line and "1.33x" in line and "8.0/16.0" in line
    broken = {"speedup_vs_sync": {"long": {k: v for k, v in long.items() if not k.startswith("per_token")}}}
    assert {"long: per_sample", "long: per_sample_gpu_s"} <= set(per_sample_without_length(broken))
    for path in sorted((REPO / "benchmarks" / "results").glob("emulated_budget2_*.json")):  # the instrument's files
        assert per_sample_without_length(json.loads(path.read_text())) == [], path.name


def test_a_run_carries_its_trained_length_its_cost_per_token_and_its_length_selection():
    run = [{"step": 0, "time_s": 0.0, "eval/accuracy": 0.4}]
    run += [{**STEP, "step": i, "time_s": float(i), "timing/step_s": 1.0, "samples": n, "response_length/mean": m,
             "length/selection": sel} for i, (n, m, sel) in enumerate([(100, 10.0, 0.1), (300, 20.0, 0.3)], 1)]
    out = summarise_run(run, target=0.5, gpus=2)
    assert out["trained_tokens"] == 7000 and out["trained_length"] == pytest.approx(17.5)  # token-weighted
    assert out["gpu_s_per_token"] == pytest.approx(2 * 2.0 / 7000) and out["length_selection"] == pytest.approx(0.2)
    assert out["eval_samples"] == [0]
    assert summarise_run(rows(1.0, [(0, 0.2)]), target=0.3)["length_selection"] is None  # not logged


def test_the_bubble_ratio_stands_beside_syncs_as_a_ratio_of_medians_and_a_paired_difference():
    from rlsys.bench import speedups

    def run(seed, bubble):
        return {**dense(1.0, [0.4, 0.5], seed=seed), "bubble_ratio": bubble}

    runs = {"sync": [run(0, 0.4), run(1, 0.5), run(2, 0.6)], "sorted": [run(0, 0.1), run(1, 0.3), run(2, 0.2)]}
    out = speedups(runs, {n: aggregate(v) for n, v in runs.items()})["sorted"]["bubble_ratio_vs_sync"]
    assert out["sync_and_this"] == [0.5, 0.2] and out["ratio"] == pytest.approx(0.4)
    assert out["paired"]["diff"] == pytest.approx(-0.3) and out["paired"]["pairs"] == 3
