"""The 128-GPU sweep: RollPacker's 32B/32k setting on 128 H800 on the held-out model, each schedule against
veRL-style sync over the grid of rlsys/sim/calibration_sources.py, summarised as a range (rlsys/sim/calibration.py
runs it)."""
from __future__ import annotations

import math

from rlsys.sim.calibration_configs import load, setting
from rlsys.sim.calibration_sources import (ANCHORED, BIASED, LENGTHS, MFU_128, OVERHEAD_128, ROLLPACKER,
                                           ROLLPACKER_TRAIN_SHARE, SWEEP_CONFIG, SWEEP_GPUS, SWEEP_PROMPTS,
                                           SWEEP_SCHEDULES)
from rlsys.sim.config import load_sim_config
from rlsys.sim.run import simulate


def rollpacker_mfu(steps: int | None) -> dict:
    """The trainer MFU RollPacker's Table 1 implies, on 128 GPUs: the 14B setting's simulated veRL training (the
    held-out model, the law's MFU on 32 GPUs) against the share of its step Table 1 gives training, over the
    published 277 s rollout; carried to 128 GPUs by the law."""
    cfg = setting("qwen14b_16k", steps or 5, None, True, schedulers=["sync"])
    simulated = simulate(cfg, quiet=True)["results"]["sync"]["train_time_s"]
    published = ROLLPACKER_TRAIN_SHARE / (1 - ROLLPACKER_TRAIN_SHARE) * ROLLPACKER["qwen14b_16k"][0][0]
    trainer = load_sim_config(cfg).trainer
    return {"mfu_128": round(trainer.mfu_on(SWEEP_GPUS) * simulated / published, 3),
            "simulated_train_s": round(simulated, 1), "published_train_s": round(published, 1),
            "law_mfu_32": round(trainer.mfu_on(cfg["cluster"]["gpus"]), 3)}


def sweep_config(point: tuple, seed: int, steps: int, schedules: list[str], values: dict) -> dict:
    """One point's config on the held-out model: veRL-style sync (G 8) and each schedule (G 4 on twice the prompts:
    the same samples), the reward pools grown with the GPUs. `values`: the figures found in this run, the MFU
    RollPacker's Table 1 implies ("implied") and the 32B setting's held-out step overhead."""
    runaway, mfu_label, overhead_label, length_label = point
    overhead = OVERHEAD_128[overhead_label] or values["held out for 32B"]
    base = load(SWEEP_CONFIG)
    grown = SWEEP_GPUS / base["cluster"]["gpus"]
    kinds = {n: {**k, "workers": round(k["workers"] * grown)} if k.get("workers") else k
             for n, k in base["reward"]["kinds"].items()}
    mfu = MFU_128[mfu_label]
    trainer = {} if mfu is None else {"mfu": values.get(mfu, mfu), "mfu_gpus": SWEEP_GPUS}
    runs = [{"name": "sync", "label": "veRL-sync"}]
    for label in schedules:
        run = SWEEP_SCHEDULES[label]
        control = {**run.get("control", {}), "group_size": 4, "prompts_per_step": 2 * SWEEP_PROMPTS}  # equal samples
        runs.append({**run, "label": label, "control": control, "reward": {"overlap": True}})
    return setting(SWEEP_CONFIG, steps, overhead, True, schedulers=runs, cluster={"gpus": SWEEP_GPUS}, seed=seed,
                   control={"prompts_per_step": SWEEP_PROMPTS}, reward={"kinds": kinds}, trainer=trainer,
                   workload={"runaway_share": runaway, **LENGTHS[length_label]})


def equal_utility(e: dict, verl: dict) -> bool:
    """Trains what veRL trains a step: its response tokens within 5%, its share of samples at the cap no more than
    three standard errors below veRL's (a scheduler that cuts long samples short trains fewer runaways; one that
    trains more, as tail does when a regenerated group's fresh samples loop, does veRL's work and more), and no more
    long prompts left waiting than a step's."""
    p = verl["capped_share"]
    return (abs(e["tokens_per_step"] - verl["tokens_per_step"]) <= 0.05 * verl["tokens_per_step"]
            and e["capped_share"] >= p - 3 * math.sqrt(p * (1 - p) / e["trained_samples"])
            and e["deferred_prompts"] <= 2 * SWEEP_PROMPTS)


def sweep_point(point: tuple, seed: int, steps: int, schedules: list[str], values: dict) -> dict:
    """One point of the sweep at one seed (`sweep_config`): every schedule against veRL-style sync, fastest first;
    the best anchored schedule at equal utility (None: none is), and the best of the rest, unvalidated."""
    cfg = sweep_config(point, seed, steps, schedules, values)
    results = simulate(cfg, quiet=True)["results"]
    reference = results["veRL-sync"]
    ranked = []
    for label, r in results.items():
        ranked.append({"schedule": label, "anchored": label in ANCHORED,
                       "speedup_vs_sync": round(reference["step_time_s"] / r["step_time_s"], 3),
                       "step_time_s": round(r["step_time_s"], 1), "rollout_time_s": round(r["rollout_time_s"], 1),
                       "train_time_s": round(r["train_time_s"], 1), "reward_wait_s": round(r["reward_wait_s"], 1),
                       "straggler_rate": round(r["straggler_rate"], 3),
                       "trained_samples": r["trained_samples"], "samples_per_step": r["trained_samples"] // r["steps"],
                       "tokens_per_step": round(r["tokens_per_s"] * r["sim_time_s"] / r["steps"]),
                       "mean_tokens": round(r["response_tokens"]["mean"]), "capped_share": r["truncated_share"],
                       "deferred_prompts": r["prompts"].get("prompts/deferred", 0)})
    verl = next(e for e in ranked if e["schedule"] == "veRL-sync")
    for e in ranked:
        e["equal_utility"] = equal_utility(e, verl)
    ranked.sort(key=lambda e: -e["speedup_vs_sync"])
    ranks = [e for e in ranked if e["schedule"] not in {"veRL-sync", *BIASED} and e["equal_utility"]]
    pick = lambda es: {k: es[0][k] for k in ("schedule", "speedup_vs_sync")} if es else None  # noqa: E731
    runaway, mfu_label, overhead_label, length_label = point
    workload = load_sim_config(cfg).workload
    return {"runaway_share": runaway, "mfu": mfu_label, "step_overhead": overhead_label, "length": length_label,
            "seed": seed, "trainer_mfu_128": round(load_sim_config(cfg).trainer.mfu_on(SWEEP_GPUS), 3),
            "step_overhead_ms": cfg["engine"]["step_overhead_ms"], "median_tokens": workload.median_tokens,
            "sigma": workload.sigma, "best": pick([e for e in ranks if e["anchored"]]),
            "best_unvalidated": pick([e for e in ranks if not e["anchored"]]),
            "best_async": pick([e for e in ranks if e["schedule"].startswith("async")]),
            "owed_to_selection": _owed(ranked), "ranked": ranked}


def _owed(ranked: list[dict]) -> float | None:
    """RollPacker's rule's speed-up over rlsys's tail's, both with the stream trainer: what the selection buys."""
    by = {e["schedule"]: e["speedup_vs_sync"] for e in ranked}
    first, whole = by.get("tail-first-R/G4"), by.get("tail/G4")
    return round(first / whole, 3) if first and whole else None


def point_key(p: dict) -> str:
    return f"runaway {p['runaway_share']:g}, mfu {p['mfu']}, overhead {p['step_overhead']}, length {p['length']}"


def summarise(points: list[dict]) -> dict:
    """The headline as a range: the best anchored schedule's speed-up over every point and seed where one trains
    what veRL trains (`unranked` counts the runs where none does), what moves it (each point's seeds' mean, least
    and most), and each schedule's range at equal utility, anchored or not."""
    ranked = [p for p in points if p["best"]]
    best = [p["best"]["speedup_vs_sync"] for p in ranked]
    by_point, by_schedule = {}, {}
    for p in ranked:
        by_point.setdefault(point_key(p), []).append(p["best"]["speedup_vs_sync"])
    for p in points:
        for e in p["ranked"]:
            if e["schedule"] != "veRL-sync" and e["equal_utility"]:
                by_schedule.setdefault(e["schedule"], []).append(e["speedup_vs_sync"])
    owed = [p["owed_to_selection"] for p in points if p.get("owed_to_selection")]
    return {"best_speedup_range": [min(best), max(best)] if best else None, "unranked": len(points) - len(ranked),
            "owed_to_selection": {"min": min(owed), "max": max(owed), "mean": round(sum(owed) / len(owed), 3),
                                  "runs": len(owed)} if owed else None,
            "best_schedules": sorted({p["best"]["schedule"] for p in ranked}),
            "by_point": {k: {"mean": round(sum(v) / len(v), 3), "min": min(v), "max": max(v), "seeds": len(v)}
                         for k, v in by_point.items()},
            "by_schedule": {s: {"anchored": s in ANCHORED, "biased": s in BIASED, "min": min(v), "max": max(v),
                                "runs": len(v)}
                            for s, v in sorted(by_schedule.items(), key=lambda kv: -max(kv[1]))},
            "unequal": {s: sum(1 for p in points for e in p["ranked"] if e["schedule"] == s and not e["equal_utility"])
                        for s in SWEEP_SCHEDULES}}
