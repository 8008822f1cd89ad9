"""`rlsys bench` figures from metrics rows: per-run summaries, equal-time accuracy, medians with spreads."""
import json
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


def test_a_run_with_tools_reports_its_calls_per_sample_at_the_first_and_last_step_and_its_first_evals_error():
    run = rows(1.0, [(0, 0.2), (4, 0.35)])
    run[0]["eval/accuracy_se"] = 0.02
    steps = [r for r in run if "timing/step_s" in r]
    for r, turns in zip(steps, (0.5, 0.7, 0.9, 1.0)):
        r["rollout/turns"] = turns
    out = summarise_run(run, target=0.3)
    assert (out["tool_calls_first"], out["tool_calls_last"], out["initial_accuracy_se"]) == (0.5, 1.0, 0.02)
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


def test_speed_up_is_the_median_of_each_repeats_pair_not_a_ratio_of_medians():
    """Repeat 1 ran on a quieter machine for both presets: its pair still reads 1.25x, while the medians of
    each preset alone (sync 4.0, other 3.5 ms) would mix repeats and read 1.14x."""
    from rlsys.bench import speedups

    def run(ms, to_target):
        return {"time_per_sample_s": ms / 1000, "time_to_target_s": to_target, "final_accuracy": 0.3,
                "final_accuracy_se": 0.01}

    runs = {"sync": [run(4.0, 40), run(2.5, 25), run(5.0, 50)],
            "other": [run(3.5, 30), run(2.0, None), run(4.0, 40)]}
    out = speedups(runs, {name: aggregate(rs) for name, rs in runs.items()})["other"]
    assert out["per_sample"] == pytest.approx(1.25) and out["per_sample_spread"] == pytest.approx([1.1429, 1.25], abs=1e-4)
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


def test_every_ratio_carries_a_bootstrap_95_interval_of_its_pairs():
    from rlsys.bench import bootstrap_interval, speedups

    def run(ms):
        return {"time_per_sample_s": ms / 1000, "gpu_s_per_sample": 2 * ms / 1000, "time_to_target_s": ms,
                "final_accuracy": 0.3, "gpus": 2}

    runs = {"sync": [run(4.0), run(4.0), run(4.0), run(4.0), run(4.0)],
            "other": [run(4.0), run(3.2), run(2.0), run(2.5), run(3.0)]}  # ratios 1.0, 1.25, 2.0, 1.6, 1.33
    out = speedups(runs, {name: aggregate(rs) for name, rs in runs.items()})["other"]
    for label in ("per_sample", "time_to_target", "per_sample_gpu_s"):
        low, high = out[f"{label}_ci95"]
        assert 1.0 <= low <= out[label] <= high <= 2.0  # within the pairs' range, around their median
    assert out["per_sample_ci95"][0] < out["per_sample_ci95"][1]  # the pairs differ: so does the interval's ends
    assert bootstrap_interval([1.5, 1.5, 1.5]) == [1.5, 1.5]


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
