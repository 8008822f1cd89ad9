"""`rlsys bench --budgets / --instrument`'s results file (rlsys/bench_budget.py): processes filling other seeds of one
matrix keep each other's runs."""
import json
import multiprocessing
from pathlib import Path

import pytest

from rlsys import bench_budget
from rlsys.bench import same_start
from rlsys.cli import main
from rlsys.errors import UserError
from helpers import SMALL_MODEL_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent


# real runs, one per seed: sync's five on cot_sum at two modelled GPUs
STORED = json.loads((ROOT / "benchmarks" / "results" / "emulated_budget_longcot_2gpu.json").read_text())["runs"]["sync"]


def record_seeds(path: str, seeds: list[int]) -> None:
    for seed in seeds:
        bench_budget.record(Path(path), {"gpus": 2}, "sync", next(r for r in STORED if r["seed"] == seed), "cmd")


def test_two_processes_recording_other_seeds_of_one_file_keep_every_run(tmp_path):
    path = tmp_path / "emulated_budget_x_2gpu.json"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=record_seeds, args=(str(path), seeds)) for seeds in ([0, 2, 4], [1, 3])]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
        assert w.exitcode == 0
    report = json.loads(path.read_text())
    assert sorted(r["seed"] for r in report["runs"]["sync"]) == [0, 1, 2, 3, 4]
    assert report["results"]["sync"]["repeats"] == 5


def test_the_file_keeps_one_order_of_presets_whichever_was_recorded_first(tmp_path):
    path = tmp_path / "emulated_budget_x_2gpu.json"
    for preset in ("async-split", "sagc", "sync", "tail"):
        bench_budget.record(path, {"gpus": 2}, preset, STORED[0], "cmd")
    report = json.loads(path.read_text())
    assert list(report["runs"]) == list(report["results"]) == ["sync", "tail", "sagc", "async-split"]


def test_every_preset_reports_its_accuracy_at_the_equal_time_the_file_now_has(tmp_path):
    """The run just added is scored at the file's equal time before its preset is aggregated, as `rlsys bench` does."""
    path = tmp_path / "emulated_budget_x_2gpu.json"
    fresh = [{k: v for k, v in r.items() if k != "accuracy_at_equal_time"} for r in STORED[:2]]
    bench_budget.record(path, {"gpus": 2}, "sync", fresh[0], "cmd")
    bench_budget.record(path, {"gpus": 2}, "tail", dict(fresh[1], seed=fresh[0]["seed"]), "cmd")
    report = json.loads(path.read_text())
    for preset in ("sync", "tail"):
        [run] = report["runs"][preset]
        assert report["results"][preset]["accuracy_at_equal_time"] == run["accuracy_at_equal_time"] is not None


def with_start(run: dict, **start) -> dict:
    return {**run, **start}


def test_a_run_from_another_starting_model_is_kept_but_left_out_of_the_figures(tmp_path):
    """Rows started from another warm-started model (another machine's CPU built other weights) would compare
    two starting points, not two schedules: the file keeps them under other_start, outside every figure."""
    path = tmp_path / "emulated_budget_x_2gpu.json"
    # as runs from before fingerprints, which only their step-0 accuracy tells apart
    sync = [with_start(r, model_fingerprint=None) for r in sorted(STORED, key=lambda r: r["seed"])[:2]]
    for run in sync:
        bench_budget.record(path, {"gpus": 2}, "sync", run, "cmd")
    moved = with_start(sync[0], initial_accuracy=sync[0]["initial_accuracy"] + 0.014)
    report_runs = bench_budget.record(path, {"gpus": 2}, "tail", moved, "cmd")
    report = json.loads(path.read_text())
    assert report["other_start"] == [["tail", sync[0]["seed"]]] and len(report_runs["tail"]) == 1
    assert "tail" not in report["results"] and "tail" not in report["speedup_vs_sync"]
    bench_budget.record(path, {"gpus": 2}, "tail", sync[1], "cmd")
    report = json.loads(path.read_text())
    assert report["results"]["tail"]["repeats"] == 1 and report["other_start"] == [["tail", sync[0]["seed"]]]


def test_fingerprints_decide_where_both_runs_logged_one():
    a = {"model_fingerprint": "a" * 16, "initial_accuracy": 0.4}
    assert same_start(a, {**a, "initial_accuracy": 0.5})  # one model, scored on another CPU
    assert not same_start(a, {**a, "model_fingerprint": "b" * 16})
    assert same_start(a, {"initial_accuracy": 0.4}) and not same_start(a, {"initial_accuracy": 0.5})


def test_runs_from_another_machines_model_are_refused_before_any_run(tmp_path):
    from rlsys.bench import started_elsewhere
    from rlsys.models import prepare_model, weights_fingerprint
    from rlsys.startup import load_config

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [
        *SMALL_MODEL_OVERRIDES, "model.warm_start.steps=0", f"model.cache_dir={tmp_path / 'cache'}"])
    here = weights_fingerprint(prepare_model(cfg))
    why = started_elsewhere([with_start(STORED[0], model_fingerprint="0" * 16)], cfg)
    assert why and "0" * 16 in why and here in why and "CPU models" in why
    assert started_elsewhere([with_start(STORED[0], model_fingerprint=here)], cfg) is None
    before_fingerprints = with_start(STORED[0], model_fingerprint=None)
    assert started_elsewhere([before_fingerprints], cfg) is None and started_elsewhere([], cfg) is None
    user = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(prepare_model(cfg))})})
    assert started_elsewhere([with_start(STORED[0], model_fingerprint="0" * 16)], user) is None  # its path names it


def test_every_stored_budget_file_measured_one_starting_model():
    """A file's ratios compare schedules only if its runs began alike; its sync is the reference (report_of)."""
    for path in sorted((ROOT / "benchmarks" / "results").glob("emulated_budget_*gpu.json")):
        if "_vs_sim_" in path.name:
            continue
        runs = json.loads(path.read_text())["runs"]
        first = bench_budget.first_run(runs)
        assert all(same_start(r, first) for v in runs.values() for r in v), path.name


def test_a_run_is_claimed_by_one_process_until_recorded_and_a_dead_processs_claim_is_taken_over(tmp_path):
    """Two processes given the same --instrument command share the matrix: neither starts a run the other holds."""
    path = tmp_path / "emulated_budget2_x_2gpu.json"
    assert bench_budget.claimed(path, "sync", 0)
    other = multiprocessing.get_context("spawn").Process(target=claim_in_another_process, args=(str(path),))
    other.start()
    other.join(timeout=120)
    assert other.exitcode == 0  # it found sync seed 0 held by this live process, and took seed 1
    assert bench_budget.read_claims(path) == {"sync/0": __import__("os").getpid(), "sync/1": other.pid}
    assert bench_budget.claimed(path, "sync", 1)  # its process has ended: the claim is free again
    bench_budget.record(path, {"gpus": 2}, "sync", dict(STORED[0], seed=0), "cmd")
    assert not bench_budget.claimed(path, "sync", 0) and "sync/0" not in bench_budget.read_claims(path)  # done, claim dropped


def claim_in_another_process(path: str) -> None:
    assert not bench_budget.claimed(Path(path), "sync", 0) and bench_budget.claimed(Path(path), "sync", 1)


def test_the_instrument_runs_more_seeds_of_the_presets_named_and_pairs_by_seed(tmp_path):
    path = tmp_path / "emulated_budget2_x_2gpu.json"
    assert bench_budget.seed_counts(["sync", "sorted", "sorted-partial"], 3, bench_budget.PRESET_SEEDS) == {
        "sync": 8, "sorted": 3, "sorted-partial": 8}
    for run in STORED:  # sync's five seeds, and tail's on two of them, recorded out of order
        bench_budget.record(path, {"gpus": 2}, "sync", run, "cmd")
    for seed in (3, 1):
        bench_budget.record(path, {"gpus": 2}, "tail", next(r for r in STORED if r["seed"] == seed), "cmd")
    report = json.loads(path.read_text())
    tail = report["speedup_vs_sync"]["tail"]
    assert tail["pairs"] == 2 and tail["per_sample"] == 1.0  # each tail run met its own seed's sync run
    assert tail["per_sample_ci95"] == [1.0, 1.0] and "t interval" in report["intervals"]
    assert set(report["targets"]) == {"gain_25", "gain_50", "gain_75", "final_less_se"}


def test_the_instruments_eval_size_resolves_the_smallest_target_to_a_third_of_its_gap():
    import math
    import statistics

    from rlsys.bench import sync_targets

    size, how = bench_budget.eval_size_for("longcot", 2)
    start = statistics.median(r["eval_curve"][0][1] for r in STORED)
    p = statistics.median(r["eval_curve"][-1][1] for r in STORED)
    gap = sync_targets(STORED)["gain_25"] - start
    assert bench_budget.EVAL_SIZES[0] <= size <= bench_budget.EVAL_SIZES[1] and math.sqrt(p * (1 - p) / size) <= gap / 3
    assert math.sqrt(p * (1 - p) / (size - 1)) > gap / 3 or size == bench_budget.EVAL_SIZES[0]  # no larger than needed
    assert "emulated_budget_longcot_2gpu.json" in how


def plan_of(budgets: str, presets: str, results_dir, capsys) -> str:
    """What `rlsys bench --instrument --plan-only` prints for the longcot workload."""
    assert main(["bench", "--instrument", "--workloads", "longcot", "--budgets", budgets, "--presets", presets,
                 "--results-dir", str(results_dir), "--plan-only"]) == 0
    return capsys.readouterr().out


def test_the_plan_counts_the_runs_left_and_writes_nothing(tmp_path, capsys):
    out = plan_of("2", "sync,sorted", tmp_path, capsys)
    assert "emulated_budget2_longcot_2gpu.json: sync 8 x" in out and "sorted 3 x" in out
    assert "[budget] plan: 11 runs" in out and list(tmp_path.iterdir()) == []


def test_a_preset_whose_trainer_cannot_fit_its_gpus_is_named_refused_and_planned_for_nothing(tmp_path, capsys):
    """At two modelled GPUs a split layout leaves Qwen2.5-7B's Adam states one H100: refused, not run."""
    out = plan_of("2,4", "sync,async-split", tmp_path, capsys)
    assert "async-split on 2 GPUs refused" in out and "needs 125 GB" in out
    assert "async-split on 4 GPUs refused" not in out
    assert "emulated_budget2_longcot_2gpu.json: sync 8 x" in out and "async-split 3 x" in out  # the 4-GPU file's
    assert "[budget] plan: 19 runs" in out  # 8 + 8 sync, 3 async-split at 4 GPUs only


def test_a_schedule_that_generates_while_it_trains_shares_its_gpus_resident_or_is_refused(tmp_path, capsys):
    """async and the streamed trainer keep the engines generating while the trainer trains, so colocated they
    cannot sleep; resident on 2 modelled H100s, a 7B trainer's states leave the engines no KV cache."""
    out = plan_of("2", "sync,async-eta2,tail-streamed", tmp_path, capsys)
    for preset in ("async-eta2", "tail-streamed"):
        assert f"{preset} on 2 GPUs refused" in out
    assert out.count("leave no KV cache (emulate.colocation=resident") == 2 and "sync on 2 GPUs refused" not in out


def test_an_instrument_file_carries_its_start_model_so_any_machine_adds_to_it(tmp_path):
    from rlsys.models import prepare_model, weights_fingerprint
    from rlsys.startup import load_config

    config = str(ROOT / "configs" / "tiny.yaml")
    short = [*SMALL_MODEL_OVERRIDES, "model.warm_start.steps=0", f"model.cache_dir={tmp_path / 'cache'}"]
    path = tmp_path / "emulated_budget2_x_2gpu.json"
    start = bench_budget.start_model(path, config, short)
    assert start == tmp_path / "start_models" / path.stem
    here = weights_fingerprint(start)
    assert here == weights_fingerprint(prepare_model(load_config(config, short)))
    (tmp_path / "cache").rename(tmp_path / "another_machine")  # the copy is used, not this machine's build
    assert bench_budget.start_model(path, config, short) == start and not (tmp_path / "cache").exists()
    run = load_config(config, short + [f"model.path={start}"])
    assert weights_fingerprint(prepare_model(run)) == here
    assert bench_budget.other_start_model({}, start) is None
    assert bench_budget.other_start_model({"sync": [{"model_fingerprint": here}]}, start) is None
    why = bench_budget.other_start_model({"sync": [{"model_fingerprint": "0" * 16}]}, start)
    assert "0" * 16 in why and here in why


def test_the_matrix_and_the_single_workload_bench_refuse_each_others_options(tmp_path, capsys):
    """One `rlsys bench`: --budgets, --workloads or --instrument choose the matrix, whose workloads have their own
    configs; the options of one are refused, naming them, by the other."""
    with pytest.raises(UserError, match="--repeats, --target: not with --budgets"):
        main(["bench", "--budgets", "2", "--repeats", "3", "--target", "+0.1", "--traceback"])
    with pytest.raises(UserError, match="a config or overrides: not with --instrument"):
        main(["bench", "--instrument", "trainer.total_steps=3", "--traceback"])
    with pytest.raises(UserError, match="--seeds: only with --budgets, --workloads or --instrument"):
        main(["bench", "--seeds", "3", "--traceback"])
    assert main(["bench", "--instrument", "--workloads", "nope"]) == 2
    assert "unknown workload 'nope'; known: old, longcot" in capsys.readouterr().err
