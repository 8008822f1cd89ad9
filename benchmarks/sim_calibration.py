"""The simulator against the published figures (docs/performance.md "Calibration sources"), then the best schedule at 128 GPUs.

    python benchmarks/sim_calibration.py --output benchmarks/results/sim_calibration.json

Each row: published, simulated, their ratio, and whether the config was fitted to it (`fitted`) or the row is
a prediction. Rows outside +-15% carry a note: what the paper leaves unstated and what we assumed.
Then every scheduler x group sizer x staleness bound x async split at 128 H800 in the calibrated regimes
(RollPacker's 32B/32k and 14B/16k configs, the batch grown with the GPUs), each with the reward scheduler and
streamed training, against veRL-style sync.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from rlsys import costs
from rlsys.bench import machine
from rlsys.sim.run import simulate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"
TOLERANCE = 0.15
STACK = ["tail", "tail+reward", "tail+reward+planner", "tail+reward+planner+stream"]
ROLLPACKER = {  # config: (veRL / tail rollout s, cumulative stack speedups)
    "qwen7b_8k": ((82, 47), (1.30, 2.01, 2.01, 2.03)),
    "qwen14b_16k": ((277, 88), (1.48, 1.99, 2.02, 2.22)),
    "qwen32b_32k": ((673, 170), (2.21, 2.48, 2.52, 2.56)),
}
FITTED = {"rollout veRL", "rollout tail", "tail", "tail+reward"}  # see each config's header
PLANNER = (  # the planner rows' shared reason, with this run's figures
    "the planner picks each round's TP before it starts: short rounds by the cost model, long rounds at most TP{base} "
    "(RollPacker measured its long rounds slower at the larger TP; see the TP2:TP1 rows); it ran the short rounds "
    "after the first mostly at TP{tp}: {planned[short]:.0f} s against {kept[short]:.0f} s at TP{base}, long rounds "
    "{planned[long]:.0f} s against {kept[long]:.0f} s")
NOTES = {  # what each missing row's paper leaves unstated, and what we assumed for it
    "scaling": (
        "RollPacker states batch and GPUs per point (weak scaling), not what it held fixed besides. We hold both "
        "reward pools at their 32-GPU fit (veRL's 18 workers, the reward scheduler's 45), lose trainer MFU as "
        "Megatron's published MFU falls with data-parallel GPUs (trainer.comm_per_gpu) and keep rollout work per "
        "GPU; a longer batch "
        "maximum adds nothing here, as 1% runaway samples reach the 16k cap at every size. Then {who}'s step "
        "grows {sim:.2f}x from 32 GPUs against the {published:.2f}x the paper's throughput implies; over the "
        "doublings {steps}. The paper's veRL step grows by about 0.4 of its 32-GPU step on each doubling and "
        "hardly in proportion to the batch (1.41x, then 1.30x); ours grows mostly in proportion (the reward wait "
        "on the fixed pool, about 15% of the 32-GPU step) and by the trainer's MFU loss. {missing}"),
    "verl fully-async": (
        "the page states 128 H20, 28k responses, 512 x 16 samples, 64:64 GPUs and its phase times, not "
        "the response lengths or the staleness as an age bound; we fit each mode's trainer MFU to its published "
        "trainer time (168 s colocated on 128, 113 s on 64 alone), take RollPacker's 32k lengths, and "
        "eta 2 for staleness_threshold 0.5 with partial rollouts (eta 1: 1.88x)"),
    "verl rollout sync": (
        "the longest sample bounds it: 1% runaway samples reach the 28k cap every step here (~6.5 ms a token "
        "at the end of the rollout); the page's 178 s is a 400-step average over lengths that grow in training, "
        "and differ between its runs: its 64-GPU colocated run generates the same 512 x 16 batch under the same "
        "cap in 151 s, 15% faster on half the GPUs, below the 174 s our cost model needs to decode 28,672 tokens "
        "on an H20 (5.1 ms of weight reads and 1 ms of overhead a step), so there its longest samples did not reach "
        "the cap in an average step"),
}


def load(name: str, **changes) -> dict:
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


def row(name: str, published: float, simulated: float, fitted: bool = False, note: str | None = None,
        at_least: bool = False, same_as: str | None = None) -> dict:
    """`at_least`: the paper gives a lower bound ("more than"), met or not. `same_as`: why the row equals
    another by construction; such a row, like a fitted one, is no prediction."""
    ratio = simulated / published
    within = ratio >= 1 if at_least else abs(ratio - 1) <= TOLERANCE
    out = {"name": name, "published": published, "simulated": round(simulated, 3), "ratio": round(ratio, 3),
           "fitted": fitted, "within": within}
    if same_as:
        out["same_as"] = same_as
    if not within:
        out["note"] = note or "no reason recorded"
    return out


def predicted(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["fitted"] and "same_as" not in r]


def hit_rate(rows: list[dict]) -> dict:
    """The predictions within 15% of their published figure: the calibration's headline."""
    ahead = predicted(rows)
    return {"predicted": len(ahead), "within": sum(r["within"] for r in ahead)}


def rollpacker_rows(steps: int | None) -> list[dict]:
    rows = []
    for config, ((verl_s, tail_s), speedups) in ROLLPACKER.items():
        needed = {"sync", *STACK} | ({"sorted"} if config == "qwen7b_8k" else set())
        cfg = load(config, **_steps(steps))
        cfg["schedulers"] = [r for r in cfg["schedulers"] if _label(r) in needed]  # not the configs' others
        r = simulate(cfg, quiet=True)["results"]
        rows.append(row(f"{config} rollout veRL s", verl_s, r["sync"]["rollout_time_s"], True))
        rows.append(row(f"{config} rollout tail s", tail_s, r["tail"]["rollout_time_s"], True))
        for label, published in zip(STACK, speedups):
            name = f"{config} {label}"
            idle_planner = "planner" in label and len(set(r[label]["tp_per_step"])) == 1
            same = f"{config} {label.replace('+planner', '')}: the planner kept TP" if idle_planner else None
            if same and "stream" in label:
                same = None  # no row without the planner but with the stream trainer to equal
            rows.append(row(f"{name} speedup", published, r[label]["speedup_vs_sync"], label in FITTED,
                            NOTES.get(name) or _planner_note(r, label, cfg["cluster"]["tp"]), same_as=same))
        if config == "qwen7b_8k":  # SortedRL's setting is unstated: RollPacker's smallest stands in
            cut = 1 - r["sorted"]["bubble_ratio"] / r["sync"]["bubble_ratio"]
            rows.append(row("sortedrl bubble ratio cut (>0.5)", 0.5, cut, at_least=True,
                            note="SortedRL's lengths and batch are unpublished; RollPacker's 7B/8k stands in"))
    return rows


TP_ROUNDS = {"short": (1029, 768), "long": (1172, 1284)}  # RollPacker's Qwen3-8B/32k rounds, s at TP1 / TP2
TP_GRID = [round(0.70 + 0.02 * i, 2) for i in range(16)]  # tp_efficiency values tried


def round_seconds(result: dict) -> dict:
    """A tail run's mean rollout seconds of its short and of its long rounds."""
    longs, rollout = set(result["long_round_steps"]), result["rollout_by_step_s"]
    pick = {"short": [s for i, s in enumerate(rollout) if i not in longs],
            "long": [s for i, s in enumerate(rollout) if i in longs]}
    return {kind: sum(v) / len(v) for kind, v in pick.items() if v}


def tp_fit(steps: int | None, grid: list[float] = TP_GRID) -> dict:
    """engine.tp_efficiency fitted to the TP2:TP1 speed of RollPacker's short and long rounds (least squares in
    log: the published pair disagrees, TP2 gains on short rounds and loses on long ones, and no one
    efficiency gives both). rlsys/costs.py TP_EFFICIENCY holds the value found here."""
    run = lambda label, e: simulate(load("qwen3_8b_32k_tp", **_steps(steps), engine={"tp_efficiency": e},
                                         schedulers=[r for r in load("qwen3_8b_32k_tp")["schedulers"]
                                                     if r["label"] == label]), quiet=True)["results"][label]
    tp1 = round_seconds(run("tp1", 1.0))  # tp=1 pays no efficiency
    error, best, ratios = math.inf, None, None
    for e in grid:
        tp2 = round_seconds(run("tp2", e))
        r = {kind: tp1[kind] / tp2[kind] for kind in TP_ROUNDS}
        err = sum(math.log(r[k] * t2 / t1) ** 2 for k, (t1, t2) in TP_ROUNDS.items())
        if err < error:
            error, best, ratios = err, e, r
    return {"tp_efficiency": best, "fitted": True, "in_costs": costs.TP_EFFICIENCY,
            "tp1_round_s": {k: round(v, 1) for k, v in tp1.items()},
            "tp2_over_tp1_speed": {k: {"published": round(t1 / t2, 3), "simulated": round(ratios[k], 3)}
                                   for k, (t1, t2) in TP_ROUNDS.items()}}


def _planner_note(results: dict, label: str, base_tp: int) -> str | None:
    """Why a planner row misses, from its run: the TP it chose and its rounds against the planner-less run's."""
    if "planner" not in label:
        return None
    sizes = results[label]["tp_per_step"][1:] or results[label]["tp_per_step"]  # the first round plans nothing
    rounds = lambda r: {"short": math.nan, "long": math.nan, **round_seconds(r)}  # noqa: E731 (some lack long rounds)
    return PLANNER.format(tp=max(set(sizes), key=sizes.count), base=base_tp, planned=rounds(results[label]),
                          kept=rounds(results["tail+reward"]))


def tp_rows(fit: dict) -> list[dict]:
    """The TP fit's anchors as fitted rows: how near one efficiency comes to both."""
    note = ("one efficiency for both: TP2 gains on RollPacker's short rounds and loses on its long ones, while the "
            "simulated rounds (TP1 short {short:.0f} s, long {long:.0f} s, against 1,029 and 1,172) gain alike. In "
            "10-step probes with long rounds admitted at once (the published ones pre-empted 2,900 times), the "
            "published preemption counts pin the KV room: memory_fraction 0.42 gives 2,500-4,700 a short round at "
            "TP1 and 2,300-3,300 a long one (published 5,199 and 2,900; at 0.9 about 1,200-1,900 and 1,500), and "
            "there TP2's larger KV share per GPU speeds short rounds 1.31-1.51x and long ones 1.20-1.68x. A per-step "
            "cost of TP2 (its all-reduces' latency, in place of the efficiency) slows both alike: wherever the TP1 "
            "short round lasted within 25% of the published 1,029 s, the long round's gain stayed at most 0.13 below "
            "the short round's (published 0.43), over memory_fraction 0.42-0.9, median_tokens 2,000-7,500, sigma "
            "0.4-1.2, prompt_share 0-0.65, runaway_share 0-0.06, max_seqs 64-1,024, efficiency 0.8-1 and "
            "all-reduces of 10-80 us. Both rows landed within 15% once, at 80 us an all-reduce and memory 0.42 "
            "(1.14 and 1.04), with TP1 rounds of 1,959 and 2,817 s; and 80 us is 10.2 ms a step for the 32B "
            "setting's 128 all-reduces, more than the whole fixed step cost its veRL rollout is fitted with (5.4 ms). "
            "The simulated long round stays bound by throughput under pre-emption (its late samples wait for KV "
            "room), not by its longest samples' latency, where RollPacker places TP2's communication cost")
    return [row(f"qwen3-8b/32k {kind} round TP2:TP1 speed", v["published"], v["simulated"], True,
                note.format(**fit["tp1_round_s"]))
            for kind, v in fit["tp2_over_tp1_speed"].items()]


SCALING = {32: (1.0, 2.22), 64: (1.42, 3.37), 128: (2.18, 4.81)}  # GPUs: veRL / RollPacker throughput, vs veRL at 32


def scaling_rows(steps: int | None) -> list[dict]:
    """14B/16k, batch 128 -> 512 on 32 -> 128 GPUs; throughput in trained prompts/s relative to veRL at 32."""
    points, base, verl = [], None, {}
    for gpus, prompts in ((32, 128), (64, 256), (128, 512)):
        stack = {**_stack_run("qwen14b_16k"), "label": "rollpacker"}
        cfg = load("qwen14b_16k", steps=steps or 10, schedulers=["sync", stack],
                   cluster={"gpus": gpus}, control={"prompts_per_step": prompts})
        r = simulate(cfg, quiet=True)["results"]
        rate = {k: v["trained_prompts"] / v["sim_time_s"] for k, v in r.items()}
        base = base or rate["sync"]
        points.append((gpus, rate["sync"] / base, rate["rollpacker"] / base))
        verl[gpus] = r["sync"]
    missing = _missing_cost(points, verl)
    rows = []
    for gpus, verl, packer in points:
        # a point's step over the 32-GPU one: batch growth over throughput growth
        grown = lambda rate, base_rate: gpus / 32 * base_rate / rate
        for who, sim, col, same in (("veRL", verl, 0, gpus == 32), ("rollpacker", packer, 1, False)):
            pub = SCALING[gpus][col]
            note = NOTES["scaling"].format(who=who, sim=grown(sim, points[0][1 + col]),
                                           published=grown(pub, SCALING[32][col]), steps=_doublings(points, col),
                                           missing=missing)
            rows.append(row(f"scaling 14b_16k {gpus} gpus {who}", pub, sim, note=note,
                            same_as="the normalisation: veRL at 32 GPUs is 1" if same else None))
    return rows


def _missing_cost(points: list, verl: dict) -> str:
    """What veRL's simulated steps lack, in 32-GPU steps: the cost that, added on each doubling, brings the 64-GPU
    row to the paper's; where it, or the same added per 128 more prompts, puts the 128-GPU row; and the MFU the
    trainer would have to keep on the first doubling to supply it alone."""
    step = {gpus: gpus / 32 / rate for gpus, rate, _ in points}  # each point's step over the 32-GPU one
    extra = 2 / SCALING[64][0] - step[64]
    at_128 = lambda added: 4 / (step[128] + added) / SCALING[128][0]  # noqa: E731
    keep = verl[32]["train_time_s"] / (verl[64]["train_time_s"] + extra * verl[32]["step_time_s"])
    return (f"What is missing grows with the scale's logarithm, not with the batch: {extra:.2f} of the 32-GPU step "
            f"more on each doubling would put both veRL rows within 15% (1.00, {at_128(2 * extra):.2f}), the same per "
            f"128 more prompts would miss at 128 GPUs ({at_128(3 * extra):.2f}). The trainer alone would have to keep "
            f"{keep:.2f} of its MFU on the first doubling; colocated, weight sync stays within each node")


def _doublings(points: list, col: int) -> str:
    """Each doubling's step growth, simulated against published: batch doubled over throughput's growth."""
    return ", ".join(f"{g0}->{g1} GPUs {2 * r0[col] / r1[col]:.2f}x against "
                     f"{2 * SCALING[g0][col] / SCALING[g1][col]:.2f}x"
                     for (g0, *r0), (g1, *r1) in zip(points, points[1:]))


def _stack_run(config: str) -> dict:
    """The config's RollPacker full stack (its reward pool held as fitted at the config's GPUs)."""
    runs = load(config)["schedulers"]
    stack = next(r for r in runs if isinstance(r, dict) and r.get("label") == STACK[-1])
    return {k: v for k, v in stack.items() if k != "label"}


def _label(run) -> str:
    return run if isinstance(run, str) else run.get("label", run["name"])


def _steps(steps: int | None) -> dict:
    return {"steps": steps} if steps else {}


def async_rows(steps: int | None) -> list[dict]:
    r = simulate(load("verl_async_7b_28k", **_steps(steps)), quiet=True)["results"]
    a = r["async"]  # the trainer's wait for a batch: its step less its training and the weight sync after it
    wait = a["step_time_s"] - a["train_time_s"] - a["weight_sync_s"]
    note = NOTES["verl fully-async"]
    return [row("verl fully-async speedup (2.35-2.67)", 2.51, r["async"]["speedup_vs_sync"], note=note),
            row("verl rollout wait sync s", 178, r["sync"]["rollout_time_s"], note=NOTES["verl rollout sync"]),
            row("verl rollout wait async s", 33, max(wait, 0.0), note=note)]


# Screen every run over one of tail batching's periods (4 short rounds + 1 long), then run each schedule's best
# for four periods: sorted's early steps flatter it (its pool starts fresh: 2.89x in the screen, 2.42x over 20
# steps at 32k), and tail's later long rounds run longer than its first.
SCREEN_STEPS, CONFIRM_STEPS = 5, 20
REGIMES = {  # the calibrated configs at 128 H800, the batch grown with the GPUs (weak scaling, as RollPacker's)
    "32k": ("qwen32b_32k", 256),  # 128 prompts x 8 on 64 GPUs
    "16k": ("qwen14b_16k", 512),  # 128 prompts x 8 on 32 GPUs; RollPacker's own 128-GPU point
}
SCHEDULES = {  # label: run fields, each with the reward scheduler, and tail's with streamed training
    "sync": {"name": "sync"},
    "tail": {"name": "tail"},  # with the stream trainer: RollPacker's full stack but the planner
    "tail+planner": {"name": "tail", "control": {"elastic_tp": {"enabled": True, "max_tp": 8}}},
    # RollPacker's stream trainer whole: the rollout scaled down to half its engines at 40% of the groups (its
    # artifact's setting). The live engines do not move requests between them: a modelled schedule only.
    "tail+scale-down": {"name": "tail", "trainer": {"scale_down_at": 0.4}},
    "sorted": {"name": "sorted"},  # on-policy: a sample spans one version (partial mode with K=1 is the same)
    **{f"sorted-partial-K{k}": {"name": "sorted", "control": {"sorted": {"mode": "partial", "max_versions": k}}}
       for k in (2, 4)},
    # async: generation goes on across weight updates (partial rollouts); the rollout:trainer split searched
    **{f"async-eta{eta}-T{gpus}": {"name": "async", "cluster": {"trainer_gpus": gpus},
                                   "control": {"staleness": {"eta": eta}}}
       for eta in (1, 2) for gpus in (16, 32, 48)},
}
SIZERS = {"G4": {"group_size": 4, "scale": 2.0}, "G8": {"group_size": 8, "scale": 1.0},
          "G16": {"group_size": 16, "scale": 0.5}, "sagc": {"group_sizer": "sagc"}}
QUICK = {"schedules": ["sync", "tail", "async-eta1-T32"], "sizers": ["G8", "sagc"]}  # --quick: the JSON's shape only


def search_runs(regime: str, schedules=SCHEDULES, sizers=SIZERS) -> list[dict]:
    """Every schedule x group sizer at equal samples a step (static G with prompts scaled by 8/G, sagc with
    constant_samples), except async, which holds its prompts: its staleness bound is counted in them. Each
    scores rewards as they come on the config's reward-scheduler pool, held at its size as fitted."""
    config, prompts = REGIMES[regime]
    reward = _stack_run(config)["reward"]
    runs = [{"name": "sync", "label": "veRL-sync"}]
    for label in schedules:
        run = SCHEDULES[label]
        for sizer in sizers:
            fields = SIZERS[sizer]
            control = {k: v for k, v in fields.items() if k != "scale"}
            if "scale" in fields:
                control["prompts_per_step"] = round(prompts * fields["scale"])
            elif run["name"] == "async":
                control["sagc"] = {"prompt_rule": "constant_prompts"}
            merged = {**run.get("control", {}), **control}
            streamed = {"streamed": run["name"] == "tail"}  # the one scheduler that streams its groups
            runs.append({**run, "label": f"{label}/{sizer}", "control": merged,
                         "reward": reward, "trainer": {**run.get("trainer", {}), **streamed}})
    return runs


def headline(found: dict) -> dict:
    """Each regime's search; the 32k one's best run at equal utility (the papers' largest gains) is `best_128`."""
    best = next(e for e in found["32k"]["ranked"] if e["schedule"] != "veRL-sync" and at_equal_utility(e))
    return {"best_128": {"schedule": best["schedule"], "speedup_vs_sync": best["speedup_vs_sync"]},
            "search_128": found["32k"], "search_128_16k": found["16k"]}


def regime_config(regime: str, steps: int, runs: list[dict]) -> dict:
    config, prompts = REGIMES[regime]
    return load(config, steps=steps, schedulers=runs, cluster={"gpus": 128},
                control={"prompts_per_step": prompts})


def search_regime(regime: str, screen: int, confirm: int, schedules, sizers) -> dict:
    prompts = REGIMES[regime][1]
    runs = search_runs(regime, schedules, sizers)
    screened = _ranked(regime, runs, screen, prompts)
    complete = [e for e in screened if at_equal_utility(e) and e["schedule"] != "veRL-sync"]
    best_of = {}  # schedule -> its fastest complete run
    for e in complete:
        best_of.setdefault(e["schedule"].split("/")[0], e)
    confirmed = {e["schedule"] for e in best_of.values()} | {"veRL-sync"}
    final = _ranked(regime, [r for r in runs if r["label"] in confirmed], confirm, prompts)
    return {"config": REGIMES[regime][0], "gpus": 128, "prompts_per_step": prompts, "screen_steps": screen,
            "confirm_steps": confirm, "ranked": final, "screened": screened, "sagc": sagc_verdicts(screened)}


def at_equal_utility(entry: dict) -> bool:
    """A run that may head the search: it starved no long prompts and trains as many samples a step as veRL."""
    return entry["complete"] and entry["equal_samples"]


def _ranked(regime: str, runs: list[dict], steps: int, prompts: int) -> list[dict]:
    """The runs' figures against veRL-style sync, fastest first. `complete`: tail's long-prompt queue holds at
    most one step's prompts; more means it starved its long prompts, a speedup not at equal utility.
    `equal_samples`: within 5% of veRL's samples a step (async with sagc holds its prompts, so its sample count
    moves with G). `long_round_vs_verl_step`: tail's slowest long round (its rollout and training) over veRL's
    mean step; `its_rollout_vs_verl_rollout`: that round's rollout alone over veRL's mean rollout."""
    results = simulate(regime_config(regime, steps, runs), quiet=True)["results"]
    reference = results["veRL-sync"]["step_time_s"]
    samples = {label: round(r["tokens_per_s"] * r["sim_time_s"] / r["response_tokens"]["mean"] / r["steps"])
               for label, r in results.items()}
    ranked = []
    for label, r in results.items():
        entry = {"schedule": label, "speedup_vs_sync": round(reference / r["step_time_s"], 3),
                 "step_time_s": round(r["step_time_s"], 1), "bubble_ratio": round(r["bubble_ratio"], 3),
                 "straggler_rate": round(r["straggler_rate"], 3), "samples_per_step": samples[label],
                 "equal_samples": abs(samples[label] - samples["veRL-sync"]) <= 0.05 * samples["veRL-sync"],
                 "deferred_prompts": _deferred(r), "complete": _deferred(r) <= prompts,
                 "preemptions_per_step": round(r["preemptions_per_step"], 1)}
        ends = [0.0] + r["step_ends_s"]
        if r["long_round_steps"]:
            slowest = max(r["long_round_steps"], key=lambda i: ends[i + 1] - ends[i])
            entry["long_round_vs_verl_step"] = round((ends[slowest + 1] - ends[slowest]) / reference, 3)
            entry["its_rollout_vs_verl_rollout"] = round(
                r["rollout_by_step_s"][slowest] / results["veRL-sync"]["rollout_time_s"], 3)
        ranked.append(entry)
    return sorted(ranked, key=lambda e: -e["speedup_vs_sync"])


def _deferred(result: dict) -> int:
    """Long prompts tail batching queued for a long round that has not run (sorted's open groups are not
    counted: its pool is bounded by design and drains as it trains)."""
    return result["prompts"].get("prompts/deferred", 0)


def sagc_verdicts(ranked: list[dict]) -> list[dict]:
    """Per schedule: dynamic group sizing against the best static size. Equal utility: as many samples a step
    and no starved prompts (async holds its prompts, so there sagc's sample count moves with G)."""
    by_label = {e["schedule"]: e for e in ranked}
    out = []
    for schedule in dict.fromkeys(label.split("/")[0] for label in by_label if "/" in label):
        sagc = by_label.get(f"{schedule}/sagc")
        static = [by_label[f"{schedule}/{s}"] for s in SIZERS if s != "sagc" and f"{schedule}/{s}" in by_label]
        if not sagc or not static:
            continue
        best = max(static, key=lambda e: e["speedup_vs_sync"])
        samples = [e["samples_per_step"] for e in static + [sagc]]
        equal = max(samples) <= 1.05 * min(samples) and sagc["complete"]
        out.append({"schedule": schedule, "sagc": sagc["speedup_vs_sync"], "best_static": best["schedule"],
                    "best_static_speedup": best["speedup_vs_sync"], "equal_utility": equal,
                    "sagc_wins": equal and sagc["speedup_vs_sync"] > best["speedup_vs_sync"]})
    return out


def calibrate(steps: int | None = None, with_search: bool = True, quick: bool = False) -> dict:
    """`steps` overrides every config's step count; `quick` runs one step each and a small search. The parts
    run side by side, a process a core: each simulation is seeded, so the figures do not depend on the order."""
    start = time.perf_counter()
    report = {"machine": machine()}
    steps = 1 if quick else steps
    screen, confirm = (steps, steps) if steps else (SCREEN_STEPS, CONFIRM_STEPS)
    chosen = QUICK if quick else {"schedules": SCHEDULES, "sizers": SIZERS}
    with ProcessPoolExecutor(os.cpu_count()) as pool:  # the longest parts first
        found = {regime: pool.submit(search_regime, regime, screen, confirm, chosen["schedules"], chosen["sizers"])
                 for regime in (REGIMES if with_search else ())}
        fit = pool.submit(tp_fit, 5, TP_GRID[::5]) if quick else pool.submit(tp_fit, steps)  # a long round every 5th
        parts = [pool.submit(part, steps) for part in (rollpacker_rows, scaling_rows, async_rows)]
        report["tp_fit"] = fit.result()
        report["rows"] = tp_rows(report["tp_fit"]) + [r for part in parts for r in part.result()]
        report["hit_rate"] = hit_rate(report["rows"])
        if found:
            report.update(headline({regime: job.result() for regime, job in found.items()}))
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def print_report(report: dict) -> None:
    hits, fit = report["hit_rate"], report["tp_fit"]
    print(f"tp_efficiency fitted {fit['tp_efficiency']} (rlsys/costs.py: {fit['in_costs']}); TP2:TP1 speed "
          + ", ".join(f"{k} {v['simulated']:.2f} (published {v['published']:.2f})"
                      for k, v in fit["tp2_over_tp1_speed"].items()))
    print(f"{hits['within']} of {hits['predicted']} predicted rows within 15%")
    print(f"{'row':<52} {'published':>9} {'simulated':>9} {'ratio':>6}")
    for r in report["rows"]:
        mark = "fit" if r["fitted"] else "same" if "same_as" in r else ("" if r["within"] else "MISS")
        print(f"{r['name']:<52} {r['published']:>9.2f} {r['simulated']:>9.2f} {r['ratio']:>6.2f} {mark}")
    for found in (report[k] for k in ("search_128_16k", "search_128") if k in report):
        for key, steps in (("screened", "screen_steps"), ("ranked", "confirm_steps")):
            _print_ranking(found, found[key], found[steps])
        for v in found["sagc"]:
            print(f"sagc under {v['schedule']:<20} {v['sagc']:.2f}x against {v['best_static']} "
                  f"{v['best_static_speedup']:.2f}x{'' if v['equal_utility'] else ' (not at equal utility)'}")
    print(f"\n{report['wall_s']} s")


def _print_ranking(found: dict, ranked: list[dict], steps: int) -> None:
    print(f"\n128 H800, {found['config']} at {found['prompts_per_step']} prompts: {len(ranked)} schedules, "
          f"{steps} steps each")
    for e in ranked:
        starved = "" if e["complete"] else f"  {e['deferred_prompts']} long prompts never trained"
        starved += "" if e["equal_samples"] else "  fewer samples than veRL"
        if "long_round_vs_verl_step" in e:
            starved += (f"  long round {e['long_round_vs_verl_step']:.2f}x a veRL step (its rollout "
                        f"{e['its_rollout_vs_verl_rollout']:.2f}x veRL's)")
        print(f"{e['schedule']:<28} {e['speedup_vs_sync']:>5.2f}x  step {e['step_time_s']:>7.1f} s  "
              f"bubble {e['bubble_ratio']:.2f}  straggler {e['straggler_rate']:.2f}  "
              f"samples {e['samples_per_step']}{starved}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the rows and the search as JSON")
    parser.add_argument("--no-search", action="store_true", help="the calibration rows only")
    parser.add_argument("--steps", type=int, help="steps per run everywhere, instead of each config's")
    parser.add_argument("--quick", action="store_true",
                        help="one step per run and a 7-run search: checks the JSON's shape, not the figures")
    args = parser.parse_args(argv)
    report = calibrate(args.steps, not args.no_search, args.quick)
    print_report(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
