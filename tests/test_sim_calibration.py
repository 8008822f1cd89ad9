"""benchmarks/sim_calibration.py on a reduced run: the JSON has the issue's schema (figures are not checked), every
calibrated config holds the one set of constants, and in sample only each RollPacker setting's step overhead is
fitted, to its veRL rollout."""
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from rlsys.sim.run import simulate

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_calibration.py"


@pytest.fixture
def calibration(monkeypatch):
    spec = importlib.util.spec_from_file_location("sim_calibration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sim_calibration", module)  # its parts go to worker processes by name
    spec.loader.exec_module(module)
    return module


def test_quick_calibration_writes_the_issue_schema(calibration, tmp_path):
    out, sweep_out = tmp_path / "sub" / "calibration.json", tmp_path / "sweep.json"
    assert calibration.main(["--quick", "--output", str(out), "--sweep-output", str(sweep_out)]) == 0
    report, sweep = json.loads(out.read_text()), json.loads(sweep_out.read_text())
    for rows in (report["rows"], report["rows_out_of_sample"]):
        assert rows and all({"name", "paper", "published", "simulated", "ratio"} <= set(r) for r in rows)
        assert all("note" in r for r in rows if not r["within"])  # every miss says why
        names = [r["name"] for r in rows]
        assert len(names) == len(set(names)) and "scaling 14b_16k 32 gpus rollpacker" not in names  # no row twice
    # out of sample nothing is fitted, and every paper's rows are there
    assert not any(r["fitted"] for r in report["rows_out_of_sample"])
    assert {r["name"] for r in report["rows"]} == {r["name"] for r in report["rows_out_of_sample"]}
    assert {r["paper"] for r in report["rows"]} == {"RollPacker", "SortedRL", "veRL fully-async"}
    for key, rows in (("in_sample", report["rows"]), ("out_of_sample", report["rows_out_of_sample"])):
        hits, counted = report["hit_rate"][key], [r for r in rows if not r["fitted"] and "same_as" not in r]
        assert hits["rows"] == len(counted) and hits["within"] == sum(r["within"] for r in counted)
        assert sum(h["rows"] for h in hits["by_paper"].values()) == hits["rows"]
    assert report["constants"] == calibration.CONSTANTS
    assert set(report["step_overheads"]) == set(calibration.ROLLPACKER)
    assert all(f["median_tokens"] == calibration.CITED_MEDIAN for f in report["step_overheads"].values())
    # the sweep: every point ranks veRL and the schedules, its best at equal utility, at the cited median and the
    # 32B setting's fitted step overhead or the shared one
    assert [(p["runaway_share"], p["mfu"], p["step_overhead"]) for p in sweep["points"]] == calibration.QUICK["points"]
    fitted_32b = report["step_overheads"][calibration.SWEEP_CONFIG]["step_overhead_ms"]
    shared = calibration.CONSTANTS["engine.step_overhead_ms"]
    assert [p["step_overhead_ms"] for p in sweep["points"]] == [fitted_32b, shared]
    assert all(p["median_tokens"] == calibration.CITED_MEDIAN for p in sweep["points"])
    for p in sweep["points"]:
        ranked = p["ranked"]
        assert [e["speedup_vs_sync"] for e in ranked] == sorted((e["speedup_vs_sync"] for e in ranked), reverse=True)
        assert {e["schedule"] for e in ranked} == {"veRL-sync", *calibration.QUICK["schedules"]}
        verl = next(e for e in ranked if e["schedule"] == "veRL-sync")
        best = next((e for e in ranked if e["schedule"] != "veRL-sync" and e["equal_utility"]), verl)
        assert p["best"] == {"schedule": best["schedule"], "speedup_vs_sync": best["speedup_vs_sync"]}
        assert all(e["equal_utility"] == calibration.equal_utility(e, verl) for e in ranked) and verl["equal_utility"]
    low, high = sweep["summary"]["best_speedup_range"]
    assert low == min(p["best"]["speedup_vs_sync"] for p in sweep["points"]) and high >= low
    assert {"cpus", "python", "load_average_at_start"} <= set(report["machine"]) and report["wall_s"] > 0
    assert report["cpu_s"] > 0 and sweep["cpu_s"] == report["cpu_s"]  # the workers' time counted: load-free


def test_calibrated_configs_share_the_constants(calibration):
    for name in calibration.CALIBRATED:
        calibration.load(name)  # raises where a config departs
    raw = yaml.safe_load((calibration.CONFIGS / "qwen14b_16k.yaml").read_text())
    drifted = copy.deepcopy(raw)
    drifted["schedulers"][1] = {"name": "tail", "trainer": {"mfu": 0.026}}
    with pytest.raises(ValueError, match="run tail: .*departs from the shared constants"):
        calibration.check_constants("qwen14b_16k", drifted)
    drifted = copy.deepcopy(raw)
    drifted["engine"]["step_overhead_ms"] = 8.81
    with pytest.raises(ValueError, match="departs from the shared constants"):
        calibration.check_constants("qwen14b_16k", drifted)
    drifted = copy.deepcopy(raw)
    drifted["workload"]["median_tokens"] = 7490  # the median the earlier design fitted
    with pytest.raises(ValueError, match="departs from the cited 1160"):
        calibration.check_constants("qwen14b_16k", drifted)
    # a run's step overhead departs only as a setting's fit, never as a change to a loaded config
    with pytest.raises(ValueError, match="only as a RollPacker setting's fitted value"):
        calibration.load("qwen14b_16k", engine={"step_overhead_ms": 8.81})


def test_in_sample_fit_moves_only_the_step_overhead(calibration):
    """In sample a RollPacker setting departs from its config only in its fitted step overhead, its median held at
    the cited figure, and the fit puts its sync run's rollout on the published veRL one."""
    fit = calibration.fit_overhead("qwen7b_8k", 1)
    overhead = fit["step_overhead_ms"]
    low, high = calibration.OVERHEAD_MS
    assert fit["median_tokens"] == calibration.CITED_MEDIAN and low < overhead < high
    fitted, kept = calibration.setting("qwen7b_8k", 1, overhead), calibration.setting("qwen7b_8k", 1)
    assert fitted["engine"].pop("step_overhead_ms") == overhead
    assert fitted == kept and kept["workload"]["median_tokens"] == calibration.CITED_MEDIAN
    run = calibration.setting("qwen7b_8k", 1, overhead, schedulers=["sync"])
    rollout = simulate(run, quiet=True)["results"]["sync"]["rollout_time_s"]
    assert abs(rollout / fit["target_rollout_s"] - 1) < 0.03, (rollout, fit)


def test_held_out_settings_take_nothing_from_rollpackers_rows(calibration):
    """RollPacker held out: the cited median, the shared step overhead, TP split ideally; the reward pools stay the
    artifact's setup (32 math and 32 sandbox workers, the judge on every GPU), an input like the GPU count."""
    cfg = calibration.setting("qwen32b_32k", 1, held_out=True)
    assert cfg["workload"]["median_tokens"] == 1160 and cfg["engine"]["tp_efficiency"] == 1.0
    assert "step_overhead_ms" not in cfg["engine"]  # the default: the shared constant (check_constants holds it)
    pools = {name: kind["workers"] for name, kind in cfg["reward"]["kinds"].items()}
    assert pools == {"rule": 32, "sandbox": 32, "judge": cfg["cluster"]["gpus"]}


def test_sweep_grows_every_reward_pool_with_the_gpus(calibration):
    """At 128 GPUs every pool of the 64-GPU artifact setup doubles, the sandbox's as the judge's: each kind scores
    twice the samples."""
    base = calibration.load(calibration.SWEEP_CONFIG)
    cfg = calibration.sweep_config(0.01, "law", "fitted 32B", 1, ["tail/G4"], 3.0)
    grown = calibration.SWEEP_GPUS / base["cluster"]["gpus"]
    assert grown == 2 and cfg["cluster"]["gpus"] == calibration.SWEEP_GPUS
    pools = {n: k["workers"] for n, k in cfg["reward"]["kinds"].items()}
    assert pools == {n: grown * k["workers"] for n, k in base["reward"]["kinds"].items()}
    assert {"sandbox", "judge"} <= set(pools)


def test_equal_utility_compares_trained_tokens_and_the_share_at_the_cap(calibration):
    """A schedule trains what veRL trains only with as many response tokens a step and as many samples at the cap:
    the same samples a step, each shorter, or its runaways cut short, is not equal utility."""
    verl = {"tokens_per_step": 2165 * 2048, "capped_share": 0.0115, "trained_samples": 5 * 2048,
            "deferred_prompts": 0}
    same = dict(verl)
    assert calibration.equal_utility(same, verl)
    assert not calibration.equal_utility({**same, "tokens_per_step": 1621 * 2048}, verl)  # samples 25% shorter
    assert not calibration.equal_utility({**same, "capped_share": 0.0017}, verl)  # runaways cut short
    assert calibration.equal_utility({**same, "capped_share": 0.0105}, verl)  # within sampling noise
    assert not calibration.equal_utility({**same, "deferred_prompts": 3 * calibration.SWEEP_PROMPTS}, verl)
