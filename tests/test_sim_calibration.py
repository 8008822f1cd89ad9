"""rlsys/sim/calibration.py (`rlsys simulate --calibrate`) on a reduced run: the JSON has the issue's schema (figures
are not checked), every calibrated config holds the one set of constants, in sample only each RollPacker setting's
step overhead is fitted, to its veRL rollout, and held out and in the 128-GPU sweep the one held-out model runs."""
import copy
import json
import math

import pytest
import yaml

from rlsys.cli import main
from rlsys.errors import UserError
from rlsys.sim.calibration_configs import (CONFIGS, _uncapped, as_measured, check_constants, fit_overhead,
                                           leave_one_out, load, run_label, setting)
from rlsys.sim.calibration_sources import (ANCHORED, BIASED, CALIBRATED, CENTRE, CITED_MEDIAN, CONSTANTS, HELD_OUT,
                                           OVERHEAD_MS, QUICK, ROLLPACKER, ROLLPACKER_ETA_R, ROLLPACKER_P75, STACK,
                                           SWEEP_CONFIG, SWEEP_GPUS, SWEEP_PROMPTS)
from rlsys.sim.calibration_sweep import equal_utility, sweep_config
from rlsys.sim.run import simulate


def test_quick_calibration_writes_the_issue_schema(tmp_path):
    out, sweep_out = tmp_path / "sub" / "calibration.json", tmp_path / "sweep.json"
    assert main(["simulate", "--calibrate", "--quick", "--output", str(out), "--sweep-output", str(sweep_out)]) == 0
    report, sweep = json.loads(out.read_text()), json.loads(sweep_out.read_text())
    for rows in (report["rows"], report["rows_out_of_sample"], report["rows_one_out"]):
        assert rows and all({"name", "paper", "published", "simulated", "ratio"} <= set(r) for r in rows)
        assert all("note" in r for r in rows if not r["within"])  # every miss says why
        names = [r["name"] for r in rows]
        assert len(names) == len(set(names)) and "scaling 14b_16k 32 gpus rollpacker" not in names  # no row twice
    # out of sample nothing is fitted, every paper's rows are there, and the scaling rows, against which the MFU
    # law's shape was chosen, are named and not counted
    for held in (report["rows_out_of_sample"], report["rows_one_out"]):
        assert not any(r["fitted"] for r in held)
        assert {r["name"] for r in report["rows"]} == {r["name"] for r in held}
        assert {r["name"] for r in held if "in_sample_by" in r} == {
            r["name"] for r in held if r["name"].startswith("scaling") and "same_as" not in r}
    assert {r["paper"] for r in report["rows"]} == {"RollPacker", "SortedRL", "veRL fully-async"}
    for key, rows in (("in_sample", report["rows"]), ("out_of_sample", report["rows_out_of_sample"]),
                      ("one_setting_out", report["rows_one_out"])):
        hits = report["hit_rate"][key]
        counted = [r for r in rows if not r["fitted"] and "same_as" not in r and "in_sample_by" not in r]
        assert hits["rows"] == len(counted) and hits["within"] == sum(r["within"] for r in counted)
        assert sum(h["rows"] for h in hits["by_paper"].values()) == hits["rows"]
        # per experiment: every counted row in one, each experiment whole only when all its rows land
        experiments = hits["by_experiment"]
        assert sum(h["rows"] for h in experiments.values()) == hits["rows"] == len(counted)
        assert set(experiments) == {r["experiment"] for r in counted} and hits["experiments"] == len(experiments)
        assert hits["experiments_within"] == sum(
            all(r["within"] for r in counted if r["experiment"] == e) for e in experiments)
    # held out, RollPacker's rule against rlsys's whole groups on every stack row: the part owed to selection
    share = report["selection_share"]
    assert set(share) == {r["name"] for r in report["rows_whole_groups"] if r["name"].endswith("speedup")}
    assert all(v["owed_to_selection"] == round(v["first_r"] / v["whole_groups"], 3) for v in share.values())
    assert sweep["summary"]["owed_to_selection"]["runs"] == len(sweep["points"])
    assert report["constants"] == CONSTANTS
    assert set(report["step_overheads"]) == set(ROLLPACKER)
    assert all(f["median_tokens"] == CITED_MEDIAN for f in report["step_overheads"].values())
    # held out one setting at a time, each setting's step overhead is the others' fits' geometric mean
    fits = {c: f["step_overhead_ms"] for c, f in report["step_overheads"].items()}
    assert report["step_overheads_one_out"] == leave_one_out(fits)
    # the sweep: every point ranks veRL and the schedules on the held-out model, at the shared step overhead or
    # the one held out for the 32B setting; its best is the best anchored schedule at equal utility
    quick = QUICK
    assert [(p["runaway_share"], p["mfu"], p["step_overhead"], p["length"]) for p in sweep["points"]] == [
        point for point in quick["points"] for _ in quick["seeds"]]
    shared = CONSTANTS["engine.step_overhead_ms"]
    assert [p["step_overhead_ms"] for p in sweep["points"]] == [shared, report["step_overheads_one_out"]["qwen32b_32k"]]
    assert sweep["model"] == HELD_OUT
    assert all(p["median_tokens"] == CITED_MEDIAN for p in sweep["points"])
    for p in sweep["points"]:
        ranked = p["ranked"]
        assert [e["speedup_vs_sync"] for e in ranked] == sorted((e["speedup_vs_sync"] for e in ranked), reverse=True)
        assert {e["schedule"] for e in ranked} == {"veRL-sync", *quick["schedules"]}
        verl = next(e for e in ranked if e["schedule"] == "veRL-sync")
        ranks = [e for e in ranked if e["schedule"] not in {"veRL-sync", *BIASED} and e["equal_utility"]]
        best = next((e for e in ranks if e["schedule"] in ANCHORED), None)
        assert p["best"] == (best and {"schedule": best["schedule"], "speedup_vs_sync": best["speedup_vs_sync"]})
        other = next((e for e in ranks if e["schedule"] not in ANCHORED), None)
        assert p["best_unvalidated"] == (other and {k: other[k] for k in ("schedule", "speedup_vs_sync")})
        assert all(e["equal_utility"] == equal_utility(e, verl) for e in ranked) and verl["equal_utility"]
    # the range over the runs where an anchored schedule trains what veRL trains; the others counted apart
    ranked = [p["best"]["speedup_vs_sync"] for p in sweep["points"] if p["best"]]
    assert sweep["summary"]["best_speedup_range"] == ([min(ranked), max(ranked)] if ranked else None)
    assert sweep["summary"]["unranked"] == len(sweep["points"]) - len(ranked)
    assert {"cpus", "python", "load_average_at_start"} <= set(report["machine"]) and report["wall_s"] > 0
    assert report["cpu_s"] > 0 and sweep["cpu_s"] == report["cpu_s"]  # the workers' time counted: load-free


def test_the_calibration_and_a_config_refuse_each_others_options(capsys):
    """One `rlsys simulate`: --calibrate runs the calibrated configs, so a config is refused beside it, and its own
    options are refused without it, each named, before anything runs."""
    with pytest.raises(UserError, match=r"a config \(configs/sim/qwen7b_8k.yaml\): not with --calibrate"):
        main(["simulate", "configs/sim/qwen7b_8k.yaml", "--calibrate", "--traceback"])
    with pytest.raises(UserError, match="--quick, --sweep-output: only with --calibrate"):
        main(["simulate", "configs/sim/qwen7b_8k.yaml", "--quick", "--sweep-output", "x.json", "--traceback"])
    assert main(["simulate"]) == 2
    assert "a simulator config, e.g. configs/sim/qwen7b_8k.yaml (or `rlsys simulate --calibrate`" in \
        capsys.readouterr().err


def test_calibrated_configs_share_the_constants():
    for name in CALIBRATED:
        load(name)  # raises where a config departs
    raw = yaml.safe_load((CONFIGS / "qwen14b_16k.yaml").read_text())
    drifted = copy.deepcopy(raw)
    drifted["schedulers"][1] = {"name": "tail", "trainer": {"mfu": 0.026}}
    with pytest.raises(ValueError, match="run tail: .*departs from the shared constants"):
        check_constants("qwen14b_16k", drifted)
    drifted = copy.deepcopy(raw)
    drifted["engine"]["step_overhead_ms"] = 8.81
    with pytest.raises(ValueError, match="departs from the shared constants"):
        check_constants("qwen14b_16k", drifted)
    drifted = copy.deepcopy(raw)
    drifted["workload"]["median_tokens"] = 7490  # the median the earlier design fitted
    with pytest.raises(ValueError, match="departs from the cited 1160"):
        check_constants("qwen14b_16k", drifted)
    # a run's step overhead departs only as a setting's fit, never as a change to a loaded config
    with pytest.raises(ValueError, match="only as a RollPacker setting's fitted value"):
        load("qwen14b_16k", engine={"step_overhead_ms": 8.81})


def test_in_sample_fit_moves_only_the_step_overhead():
    """In sample a RollPacker setting departs from its config only in its fitted step overhead, its median held at
    the cited figure, and the fit puts its sync run's rollout on the published veRL one."""
    fit = fit_overhead("qwen7b_8k", 1)
    overhead = fit["step_overhead_ms"]
    low, high = OVERHEAD_MS
    assert fit["median_tokens"] == CITED_MEDIAN and low < overhead < high
    fitted, kept = setting("qwen7b_8k", 1, overhead), setting("qwen7b_8k", 1)
    assert fitted["engine"].pop("step_overhead_ms") == overhead
    assert fitted == kept and kept["workload"]["median_tokens"] == CITED_MEDIAN
    run = setting("qwen7b_8k", 1, overhead, schedulers=["sync"])
    rollout = simulate(run, quiet=True)["results"]["sync"]["rollout_time_s"]
    assert abs(rollout / fit["target_rollout_s"] - 1) < 0.03, (rollout, fit)


def test_held_out_settings_take_nothing_from_rollpackers_rows():
    """RollPacker held out: the cited median, the shared step overhead, TP split ideally, every planner's long rounds
    at the cost model's TP; the reward pools stay the artifact's setup (32 math and 32 sandbox workers, the judge on
    every GPU), an input like the GPU count."""
    cfg = setting("qwen32b_32k", 1, held_out=True)
    assert cfg["workload"]["median_tokens"] == 1160 and cfg["engine"]["tp_efficiency"] == 1.0
    assert "step_overhead_ms" not in cfg["engine"]  # the default: the shared constant (check_constants holds it)
    planners = [r["control"]["elastic_tp"] for r in cfg["schedulers"]
                if isinstance(r, dict) and "elastic_tp" in r.get("control", {})]
    assert planners and all(p["long_rounds_at_base"] is False for p in planners)
    pools = {name: kind["workers"] for name, kind in cfg["reward"]["kinds"].items()}
    assert pools == {"rule": 32, "sandbox": 32, "judge": cfg["cluster"]["gpus"]}


def test_uncapped_planner_gives_long_rounds_the_cost_models_tp():
    """The long-round cap is RollPacker's TP study's: with it a long round keeps the configured TP1, lifted (the
    held-out model) the cost model's own choice, a larger TP, runs it."""
    def long_round_tp(control: dict) -> int:
        cfg = {"name": "planner", "steps": 6, "model": "qwen2.5-7b", "cluster": {"gpus": 8, "tp": 1},
               "workload": {"max_tokens": 8192, "median_tokens": 600},
               "control": {"prompts_per_step": 32, "group_size": 8,
                           "elastic_tp": {"enabled": True, "max_tp": 4}}, "schedulers": ["tail"]}
        r = simulate({**cfg, "control": control(cfg["control"])}, quiet=True)["results"]["tail"]
        return r["tp_per_step"][r["long_round_steps"][0]]
    assert long_round_tp(lambda c: c) == 1
    assert long_round_tp(_uncapped) > 1


def test_rollpacker_rows_run_the_rule_they_measured():
    """Every tail run of a RollPacker setting keeps each prompt's first R of ceil(1.25 R) samples, the rule its rows
    measured; no other run, and not the sweep's headline tail."""
    cfg = as_measured(setting("qwen32b_32k", 1, held_out=True))
    rules = {run_label(r): r.get("control", {}).get("tail_eta_r") for r in cfg["schedulers"]}
    assert {k for k, v in rules.items() if v == ROLLPACKER_ETA_R} == {"tail", *STACK}
    assert rules["sync"] is None and rules["sorted"] is None
    sweep = sweep_config(CENTRE, 0, 1, ["tail/G4", *BIASED], {})
    rules = {r["label"]: r["control"].get("tail_eta_r") for r in sweep["schedulers"] if "control" in r}
    assert rules == {"tail/G4": None, "tail-first-R/G4": ROLLPACKER_ETA_R}


def test_leave_one_out_takes_nothing_from_the_setting_it_predicts():
    fits = {"a": 2.0, "b": 8.0, "c": 4.0}
    held = leave_one_out(fits)
    assert held == {"a": 5.66, "b": 2.83, "c": 4.0}  # the geometric mean of the other two
    assert leave_one_out({**fits, "a": 40.0})["a"] == held["a"]


def test_sweep_grows_every_reward_pool_with_the_gpus():
    """At 128 GPUs every pool of the 64-GPU artifact setup doubles, the sandbox's as the judge's: each kind scores
    twice the samples."""
    base = load(SWEEP_CONFIG)
    cfg = sweep_config(CENTRE, 0, 1, ["tail/G4"], {})
    grown = SWEEP_GPUS / base["cluster"]["gpus"]
    assert grown == 2 and cfg["cluster"]["gpus"] == SWEEP_GPUS
    pools = {n: k["workers"] for n, k in cfg["reward"]["kinds"].items()}
    assert pools == {n: grown * k["workers"] for n, k in base["reward"]["kinds"].items()}
    assert {"sandbox", "judge"} <= set(pools)


def test_sweep_runs_the_held_out_model_over_sourced_bands():
    """Every sweep point is the held-out model (ideal TP split, the shared or the held-out step overhead); the length
    point at RollPacker's P75 has that P75, and the MFU band reaches below the law as above it."""
    from rlsys.sim.config import load_sim_config
    centre = load_sim_config(sweep_config(CENTRE, 0, 1, ["tail/G4"], {}))
    assert centre.engine.tp_efficiency == 1.0 and centre.engine.step_overhead_ms == 1.0
    held = sweep_config((0.01, "law", "held out for 32B", "cited"), 0, 1, ["tail/G4"],
                                    {"held out for 32B": 5.04})
    assert held["engine"]["step_overhead_ms"] == 5.04
    p75 = load_sim_config(sweep_config((0.01, "law", "shared", "rollpacker p75"), 0, 1, [], {})).workload
    assert abs(p75.median_tokens * math.exp(0.6745 * p75.sigma) - ROLLPACKER_P75) < 10
    law = centre.trainer.mfu_on(SWEEP_GPUS)
    band = [load_sim_config(sweep_config((0.01, m, "shared", "cited"), 0, 1, [], {"implied": 0.07}))
            .trainer.mfu_on(SWEEP_GPUS) for m in ("rollpacker table 1", "megatron-lm pretraining")]
    assert band[0] < law < band[1]


def test_equal_utility_compares_trained_tokens_and_the_share_at_the_cap():
    """A schedule trains what veRL trains only with as many response tokens a step and at least as many samples at
    the cap: the same samples a step, each shorter, or its runaways cut short, is not equal utility."""
    verl = {"tokens_per_step": 2165 * 2048, "capped_share": 0.0115, "trained_samples": 5 * 2048,
            "deferred_prompts": 0}
    same = dict(verl)
    assert equal_utility(same, verl)
    assert not equal_utility({**same, "tokens_per_step": 1621 * 2048}, verl)  # samples 25% shorter
    assert not equal_utility({**same, "capped_share": 0.0017}, verl)  # runaways cut short
    assert equal_utility({**same, "capped_share": 0.0105}, verl)  # within sampling noise
    assert equal_utility({**same, "capped_share": 0.0140}, verl)  # more runaways trained: veRL's work and more
    assert not equal_utility({**same, "deferred_prompts": 3 * SWEEP_PROMPTS}, verl)
