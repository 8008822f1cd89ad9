"""A calibrated config as the calibration runs it (rlsys/sim/calibration.py): loaded with the shared constants
checked, a RollPacker setting in sample (its fitted step overhead) or held out (the held-out model), its tail runs
under RollPacker's rule, and the in-sample fit and the one-setting-out step overheads."""
from __future__ import annotations

import math
from pathlib import Path

import yaml

from rlsys.sim.calibration_sources import (CALIBRATED, CITED_MEDIAN, CONSTANTS, HELD_OUT, OVERHEAD_MS, ROLLPACKER,
                                           ROLLPACKER_ETA_R)
from rlsys.sim.config import load_sim_config
from rlsys.sim.run import simulate

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"  # the repository's; not installed


def load(name: str, **changes) -> dict:
    """A config as a dict, `changes` merged into its sections; a calibrated config must hold the shared constants,
    and its step overhead departs from them only as a setting's listed fit (`setting`), never as a change here."""
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    if name in CALIBRATED:
        check_constants(name, raw)
        if "step_overhead_ms" in changes.get("engine", {}):
            raise ValueError(f"{name}: the step overhead departs from CONSTANTS only as a RollPacker setting's "
                             "fitted value, through setting(overhead_ms=...)")
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


def check_constants(name: str, raw: dict) -> None:
    """Every run of a calibrated config holds CONSTANTS, and RollPacker's settings and veRL's page (RollPacker's 32k
    lengths) the cited median: the configs cannot drift apart, nor carry a fitted value."""
    cfg = load_sim_config(raw)
    for run in cfg.runs():
        trainer = cfg.trainer_for(run)
        held = {"engine.step_overhead_ms": cfg.engine.step_overhead_ms,
                **{f"trainer.{k}": getattr(trainer, k) for k in ("mfu", "mfu_gpus", "comm_per_gpu")}}
        if held != CONSTANTS:
            raise ValueError(f"configs/sim/{name}.yaml run {run.label}: {held} departs from the shared constants "
                             f"{CONSTANTS} (rlsys/sim/calibration_sources.py CONSTANTS)")
    if (name in ROLLPACKER or name == "verl_async_7b_28k") and cfg.workload.median_tokens != CITED_MEDIAN:
        raise ValueError(f"configs/sim/{name}.yaml: median_tokens {cfg.workload.median_tokens} departs from the "
                         f"cited {CITED_MEDIAN} (rlsys/sim/calibration_sources.py CITED_MEDIAN)")


def fit_overhead(config: str, steps: int | None, iterations: int = 8) -> dict:
    """engine.step_overhead_ms that gives the setting's sync run its published veRL rollout, at the cited median:
    bisection in log over OVERHEAD_MS (the rollout, bound by the samples that decode to the cap, grows with the
    cost of every decode step)."""
    target = ROLLPACKER[config][0][0]
    lo, hi = map(math.log, OVERHEAD_MS)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        cfg = setting(config, steps, round(math.exp(mid), 2), schedulers=["sync"])
        rollout = simulate(cfg, quiet=True)["results"]["sync"]["rollout_time_s"]
        lo, hi = (mid, hi) if rollout < target else (lo, mid)
    return {"step_overhead_ms": round(math.exp((lo + hi) / 2), 2), "target_rollout_s": target,
            "median_tokens": CITED_MEDIAN, "searched_ms": list(OVERHEAD_MS)}


def setting(config: str, steps: int | None, overhead_ms: float | None = None, held_out: bool = False,
            **changes) -> dict:
    """A RollPacker config: in sample at its fitted step overhead (fit_overhead), the one departure from CONSTANTS
    allowed; `overhead_ms` None keeps the shared one. Held out (the held-out model): its TP split ideally and its
    planner's long rounds at the cost model's TP, in every run."""
    cfg = load(config, **steps_change(steps), **changes)
    if overhead_ms is not None:
        cfg["engine"] = {**cfg["engine"], "step_overhead_ms": overhead_ms}
    if held_out:
        cfg["engine"] = {**cfg["engine"], "tp_efficiency": HELD_OUT["tp_efficiency"]}
        cfg["control"] = _uncapped(cfg["control"])
        cfg["schedulers"] = [{**r, "control": _uncapped(r["control"])} if isinstance(r, dict) and "control" in r
                             else r for r in cfg["schedulers"]]
    return cfg


def as_measured(cfg: dict) -> dict:
    """A RollPacker config whose every tail run keeps each prompt's first R of ceil(ROLLPACKER_ETA_R R) samples:
    the rule RollPacker's rows measured (rlsys/sim/first_r.py)."""
    runs = [{"name": r} if isinstance(r, str) else r for r in cfg["schedulers"]]
    rule = lambda r: {**r, "control": {**r.get("control", {}), "tail_eta_r": ROLLPACKER_ETA_R}}  # noqa: E731
    return {**cfg, "schedulers": [rule(r) if r["name"] == "tail" else r for r in runs]}


def _uncapped(control: dict) -> dict:
    """A control section whose elastic TP, where it sets one, plans long rounds by the cost model alone."""
    if "elastic_tp" not in control:
        return control
    return {**control, "elastic_tp": {**control["elastic_tp"], "long_rounds_at_base": HELD_OUT["long_rounds_at_base"]}}


def leave_one_out(fitted: dict) -> dict:
    """Each RollPacker setting's step overhead held out one setting at a time: the geometric mean of the other
    settings' fits (`fitted`: setting -> ms), nothing from its own rows."""
    return {c: round(math.exp(sum(math.log(ms) for o, ms in fitted.items() if o != c) / (len(fitted) - 1)), 2)
            for c in fitted}


def run_label(run) -> str:
    return run if isinstance(run, str) else run.get("label", run["name"])


def steps_change(steps: int | None) -> dict:
    return {"steps": steps} if steps else {}
