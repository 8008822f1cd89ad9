"""`rlsys bench`: the same workload under several presets, interleaved and repeated so that machine
noise shows as a spread, summarised in one table, one JSON file and three figures."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlsys.config import DEFAULT_CONFIG, Config, split_config_and_overrides
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.emulate import Budget, clock_label, emulated_tokens
from rlsys.errors import UserError
from rlsys.evaluate import mean_and_se
from rlsys.logger import read_jsonl
from rlsys.models import prepare_model, weights_fingerprint
from rlsys.placement import plan_from_config
from rlsys.startup import load_config

# name -> config overrides on top of the workload. Presets whose scheduler or sizer is not
# registered yet are skipped, so the table grows as schedulers land.
PRESETS: dict[str, list[str]] = {
    "sync": [],
    "tail": ["control.scheduler=tail"],
    "tail-streamed": ["control.scheduler=tail", "trainer.streamed=true"],
    # RollPacker's stream trainer: streamed on the GPUs of the engines scaled down at 40% of a round's groups
    "tail-scaledown": ["control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4"],
    "sorted": ["control.scheduler=sorted"],
    "sorted-partial": ["control.scheduler=sorted", "control.sorted.mode=partial", "trainer.loss=decoupled_ppo"],
    "sagc": ["control.group_sizer=sagc"],
    "sagc-tight": ["control.group_sizer=sagc", "control.sagc.delta=0.03"],  # a budget that binds on this task
    "G4": ["control.group_size=4", "control.prompts_per_step=32"],  # static groups, 128 samples a step
    "G16": ["control.group_size=16", "control.prompts_per_step=8"],
    "async": ["control.scheduler=async", "trainer.loss=decoupled_ppo"],
    "async-eta2": ["control.scheduler=async", "trainer.loss=decoupled_ppo", "control.staleness.eta=2"],
    "async-loglinear": ["control.scheduler=async", "trainer.loss=decoupled_ppo", "trainer.proximal=loglinear"],
    "no-tools": ["tools.fns=[]", "tools.env=null"],  # the same run without its tools or environment: the
    # baseline of a task that needs them
    "async+sagc": ["control.scheduler=async", "trainer.loss=decoupled_ppo", "control.group_sizer=sagc",
                   "control.sagc.prompt_rule=constant_prompts"],  # async keeps B prompts per update
    # Where SAGC's claim lives. A sync step waits for its slowest sample whatever G is, so there G saves time only
    # where the sample count follows it: SAGC so, against static G 4 / 8 / 16 under the same rule (B prompts of G).
    "sagc-prompts": ["control.group_sizer=sagc", "control.sagc.prompt_rule=constant_prompts"],
    "G4-prompts": ["control.group_size=4"],
    "G8-prompts": ["control.group_size=8"],
    "G16-prompts": ["control.group_size=16"],
    # and where a group's slowest sample holds back its own training (against tail+G4, sorted+G16, ...)
    "tail+sagc": ["control.scheduler=tail", "control.group_sizer=sagc"],
    "sorted+sagc": ["control.scheduler=sorted", "control.group_sizer=sagc"],
}
QUICK = ["trainer.total_steps=30", "control.eval_every=5", "data.eval_size=100", "control.save_every=0"]


# Time to target needs a target the workload reaches. A gain over the run's first eval follows a change of
# task or model; on the default task (avg@4 0.275 at step 0) +0.025 is the 0.30 the stored benches used.
DEFAULT_TARGET = "+0.025"


@dataclass(frozen=True)
class Target:
    """`--target`: an eval accuracy ("0.3"), or a gain over each run's first eval accuracy ("+0.025")."""
    value: float
    gain: bool = False

    @classmethod
    def parse(cls, text: str) -> "Target":
        try:
            return cls(float(text), gain=text.strip().startswith("+"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an accuracy (0.3) or a gain over the first "
                                             "eval (+0.025)") from None

    def accuracy(self, initial: float | None) -> float:
        return self.value + (initial or 0.0) if self.gain else self.value

    def __str__(self) -> str:
        return f"+{self.value:g}" if self.gain else f"{self.value:g}"


def preset_overrides(name: str) -> list[str]:
    """A preset's overrides; "a+b" not in PRESETS combines presets a and b (b's win where both set a key)."""
    if name in PRESETS:
        return PRESETS[name]
    parts = name.split("+")
    unknown = [p for p in parts if p not in PRESETS]
    if unknown:
        raise UserError(f"--presets: unknown preset {', '.join(map(repr, unknown))} in {name!r}; known: "
                        f"{', '.join(PRESETS)} (join two with +)")
    return [o for p in parts for o in PRESETS[p]]


def available(name: str) -> bool:
    values = dict(o.split("=", 1) for o in preset_overrides(name))
    return (values.get("control.scheduler", "sync") in SCHEDULERS
            and values.get("control.group_sizer", "fixed") in GROUP_SIZERS)


def changing_nothing(workload: Config, config: str | None, overrides: list[str], presets: list[str]) -> list[str]:
    """The presets that leave `workload` (`config` with `overrides`, loaded) as it is (no-tools on a task without
    tools): each would only run the baseline again."""
    return [p for p in presets
            if (changes := preset_overrides(p)) and load_config(config, overrides + changes) == workload]


def machine() -> dict:
    """Where a report was measured. The CPU's model and torch's kernel set for it are named because CPU runs
    round differently under other kernels: the same config warm-starts the tiny model to other weights."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_start": os.getloadavg()[0]}


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def write_report(path: str | None, report: dict) -> None:
    """A sweep's report as JSON; sweeps rewrite it after every run, so an interrupted one keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


WARMUP_STEPS = 2  # left out of the step time: the first steps pay for starting (caches, the first compile)


def crossing(curve: list[list[float]], target: float) -> float | None:
    """Where an eval curve of (cost, accuracy) points first reaches `target`, interpolated linearly between the
    eval before and the eval at or past it: one eval's cost alone would make every run that crosses between two
    evals tie. None if it never does."""
    for before, at in zip([None] + curve, curve):
        if at[1] >= target:
            if before is None or at[1] == before[1]:
                return at[0]
            return before[0] + (target - before[1]) / (at[1] - before[1]) * (at[0] - before[0])
    return None


def crossing_time(evals: list[dict], target: float) -> float | None:
    """When the eval rows' accuracy first reaches `target` (crossing)."""
    return crossing([[r["time_s"], r["eval/accuracy"]] for r in evals], target)


def samples_at_evals(rows: list[dict]) -> list[int]:
    """The samples trained before each eval row (an eval logged in a step's row comes after that step's samples)."""
    out, total = [], 0
    for r in rows:
        total += r.get("samples", 0) if "timing/step_s" in r else 0
        if "eval/accuracy" in r:
            out.append(total)
    return out


def summarise_run(rows: list[dict], target: float | Target, gpus: int | None = None) -> dict:
    """The figures of one run, from its metrics.jsonl rows; `gpus`: its GPU budget, for its GPU-seconds."""
    steps = [r for r in rows if "timing/step_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    if isinstance(target, Target):
        target = target.accuracy(evals[0]["eval/accuracy"] if evals else None)
    to_target = crossing_time(evals, target)
    samples = sum(r["samples"] for r in steps)
    mean = lambda key: statistics.mean(r[key] for r in steps) if steps else 0.0  # noqa: E731
    timed = timed_steps(steps)
    per_sample = steps[-1]["time_s"] / samples if samples else None
    trained_tokens = sum(r["samples"] * r.get("response_length/mean", 0.0) for r in steps)
    per_token = steps[-1]["time_s"] / trained_tokens if trained_tokens else None
    gpu_s = lambda t: t * gpus if t is not None and gpus else None  # noqa: E731
    selection = [r["length/selection"] for r in steps if r.get("length/selection") is not None]
    return {
        "eval_curve": [[r["time_s"], r["eval/accuracy"]] for r in evals],
        "eval_samples": samples_at_evals(rows),
        "step_time_s": statistics.mean(r["timing/step_s"] for r in timed) if timed else 0.0,
        "time_per_sample_s": per_sample,
        "gpus": gpus,
        "gpu_s_per_sample": gpu_s(per_sample),
        # a sample's cost depends on its length: per trained token beside per sample, and the length that links them
        "trained_tokens": trained_tokens,
        "trained_length": trained_tokens / samples if samples else None,
        "time_per_token_s": per_token,
        "gpu_s_per_token": gpu_s(per_token),
        "gpu_s_to_target": gpu_s(to_target),
        "bubble_ratio": mean("rollout/bubble_ratio"),
        "straggler_rate": mean("rollout/straggler_rate"),
        "efficiency": mean("rollout/efficiency"),
        "tokens_per_s": mean("throughput/tokens_per_s"),
        "target_accuracy": target,
        "time_to_target_s": to_target,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "final_accuracy_se": evals[-1].get("eval/accuracy_se") if evals else None,
        "model_fingerprint": next((r["model/fingerprint"] for r in rows if "model/fingerprint" in r), None),
        "initial_accuracy": evals[0]["eval/accuracy"] if evals else None,
        "initial_accuracy_se": evals[0].get("eval/accuracy_se") if evals else None,
        "samples": samples,
        "wall_s": steps[-1]["time_s"] if steps else 0.0,
        "response_length": mean("response_length/mean"),
        **length_shape(steps, next((r for r in rows if "emulate/tokens_per_token" in r), None)),
        "group_size": mean("group_size"),
        "length_selection": statistics.mean(selection) if selection else None,
        **{k.split("/")[1]: rows[-1][k] for k in ("emulate/overrun_share", "emulate/overrun_s", "emulate/emulating")
           if k in rows[-1]},
        **tool_calls(steps),
    }


def timed_steps(steps: list[dict]) -> list[dict]:
    """The steps the step time is measured over: those after the warm-up window; for sorted, whose update times
    alternate within a round (its short groups train first), the whole rounds that start after it (from the first
    round where none does). A round ends at the step after which the next begins (sorted/round), or, at the run's
    end, where none of its prompts is left (sorted/deferred_prompts 0)."""
    warm = steps[WARMUP_STEPS:] or steps
    if not steps or "sorted/round" not in steps[0]:
        return warm
    rounds = [r["sorted/round"] for r in steps] + [None]
    ends = [i for i, r in enumerate(steps) if rounds[i + 1] != rounds[i] and (
        rounds[i + 1] is not None or r["sorted/deferred_prompts"] == 0)]
    if not ends:
        return warm
    starts = [0] + [i + 1 for i in ends[:-1]]
    first = next((i for i in starts if i >= WARMUP_STEPS), 0)
    return steps[first:ends[-1] + 1]


def length_shape(steps: list[dict], clock: dict | None = None) -> dict:
    """The responses' length shape (tokens of the run's model) at the first and the last step: median, p90, p99,
    the share cut at the cap, and the prompts' share of the tokens trained; none for runs that did not log it.
    `clock`: the row describing the run's emulated clock (emulate/*), under which the share is the emulated
    model's: a token stands for k, a prompt for emulate.prompt_tokens where that is set."""
    keys = ("p50", "p90", "p99", "at_cap")
    if not steps or any(f"response_length/{k}" not in steps[0] for k in keys):
        return {}
    ends = (("first", steps[0]), ("last", steps[-1]))
    out = {f"length_{k}_{when}": row[f"response_length/{k}"] for when, row in ends for k in keys}
    if "prompt_length/mean" in steps[0]:
        k, per_prompt = (clock or {}).get("emulate/tokens_per_token", 1), (clock or {}).get("emulate/prompt_tokens")
        for when, row in ends:
            prompt, response = row["prompt_length/mean"], row["response_length/mean"]
            emulated_prompt = emulated_tokens(k, per_prompt, prompt, 1, prompt)
            out[f"prompt_share_{when}"] = emulated_prompt / (emulated_prompt + k * response)
    return out


def tool_calls(steps: list[dict]) -> dict:
    """A run with tools: its tool calls per sample and its environment's mean reward per call at the first and the
    last step (none without tools)."""
    out = {}
    for key, name in (("rollout/turns", "tool_calls"), ("rollout/turn_reward", "turn_reward")):
        values = [r[key] for r in steps if key in r]
        if values:
            out |= {f"{name}_first": values[0], f"{name}_last": values[-1]}
    return out


def accuracy_at(run: dict, t: float, gpu_s: bool = False) -> float | None:
    """The run's last eval accuracy at or before training wall time t (`gpu_s`: at or before t GPU-seconds)."""
    before = [acc for time_s, acc in (gpu_s_curve(run) if gpu_s else run["eval_curve"]) if time_s <= t]
    return before[-1] if before else None


def add_equal_time(runs: dict[str, list[dict]]) -> float:
    """Each run's accuracy at the wall time every run reached (the shortest run's end): the comparison
    at equal wall time, beside the full runs' comparison at equal samples."""
    t = min(r["wall_s"] for rs in runs.values() for r in rs)
    for rs in runs.values():
        for r in rs:
            r["accuracy_at_equal_time"] = accuracy_at(r, t)
    return t


def same_start(a: dict, b: dict) -> bool:
    """Two runs' summaries began from the same model: their weights' fingerprints agree where both logged one
    (rlsys.models.weights_fingerprint), else their step-0 eval accuracies do. A tiny model rebuilt on another
    CPU warm-starts to other weights, scores differently at step 0 and trains differently: its runs measure
    another starting point, not the schedule."""
    if a.get("model_fingerprint") and b.get("model_fingerprint"):
        return a["model_fingerprint"] == b["model_fingerprint"]
    return a.get("initial_accuracy") == b.get("initial_accuracy")


def started_elsewhere(runs: list[dict], cfg: Config) -> str | None:
    """Why a run of `cfg` on this machine may not join `runs` (None if it may): they logged the fingerprint of
    another model than the one this machine builds for `cfg`. Runs from before fingerprints pass; same_start
    tells them apart after the run, by their step-0 accuracy."""
    logged = next((r["model_fingerprint"] for r in runs if r.get("model_fingerprint")), None)
    if not logged or cfg.model.path:
        return None
    here = weights_fingerprint(prepare_model(cfg))
    if here == logged:
        return None
    return (f"its runs started from the model {logged}, and this machine builds {here} for this workload: the "
            "tiny model's warm start trains on the CPU, whose floating-point results differ between CPU models")


def median_of(runs: list[dict], key: str):
    """The median of `key` over repeats that have it; time to target only if every repeat reached it."""
    values = [r[key] for r in runs if r.get(key) is not None]
    if (key == "time_to_target_s" or key.startswith(("gpu_s_to_", "samples_to_"))) and len(values) < len(runs):
        return None
    return statistics.median(values) if values else None


def repeated_accuracy(runs: list[dict]) -> tuple[float, float]:
    """The mean final accuracy of repeated runs, and its standard error: the larger of the runs' spread over
    sqrt(n), which holds training noise as well as the eval's, and one eval's own error (the root mean
    square of the runs'). Every run is evaluated on the same prompts with the same seeds, so the eval's
    error does not average out over runs: identical runs (a deterministic sync schedule) keep it whole."""
    finals = [r["final_accuracy"] for r in runs]
    _, spread_se = mean_and_se(finals)
    eval_se = math.sqrt(statistics.fmean((r.get("final_accuracy_se") or 0.0) ** 2 for r in runs))
    return statistics.fmean(finals), max(spread_se, eval_se)


def aggregate(runs: list[dict]) -> dict:
    """Median over repeats, with [min, max] spreads for the figures that vary; the final accuracy is the
    mean over repeats with its standard error (`repeated_accuracy`)."""
    out: dict = {"repeats": len(runs)}
    keys = dict.fromkeys(k for r in runs for k in r)  # a run stopped early lacks its final row's keys
    for key in (k for k in keys if k != "final_accuracy_se"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if any(isinstance(v, (list, dict)) for v in values):  # a run's curve: no median
            continue
        if any(isinstance(v, str) for v in values):  # a label (the model's fingerprint): one, or each one seen
            labels = sorted(set(values))
            out[key] = labels[0] if len(labels) == 1 else labels
            continue
        out[key] = median_of(runs, key)
        if len(values) > 1:
            out[f"{key}_spread"] = [min(values), max(values)]
    out["final_accuracy_se"] = None
    if all(r.get("final_accuracy") is not None for r in runs):
        out["final_accuracy"], out["final_accuracy_se"] = repeated_accuracy(runs)
    return out


def accuracy_difference(a: dict, b: dict) -> dict | None:
    """a's final accuracy minus b's, with the standard error of the difference (independent runs): the
    difference counts as real only beyond two of them."""
    if a.get("final_accuracy") is None or b.get("final_accuracy") is None:
        return None
    diff = a["final_accuracy"] - b["final_accuracy"]
    se = ((a.get("final_accuracy_se") or 0.0) ** 2 + (b.get("final_accuracy_se") or 0.0) ** 2) ** 0.5
    return {"diff": diff, "se": se, "beyond_error": abs(diff) > 2 * se}


def paired(base: list[dict], other: list[dict]) -> list[tuple[dict, dict]]:
    """The (base, other) pairs of runs: by seed where every run names its seed (a preset may have run fewer seeds
    than sync), else repeat by repeat; the repeats ran interleaved, so the machine's load in one cancels in its pair."""
    if all("seed" in r for r in base + other):
        by_seed = {r["seed"]: r for r in base}
        return [(by_seed[o["seed"]], o) for o in other if o["seed"] in by_seed]
    return list(zip(base, other))


def pair_ratios(base: list[dict], other: list[dict], key: str) -> list[float | None]:
    """base / other for each pair (`paired`)."""
    return [b[key] / o[key] if b.get(key) and o.get(key) else None for b, o in paired(base, other)]


# t's 97.5% quantile for 1 to 30 degrees of freedom: a few seeds give a wider interval than the normal's 1.96
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(dof: int) -> float:
    """t's 97.5% quantile: the table to 30 degrees of freedom, beyond it the normal's with two Cornish-Fisher terms
    (within 0.001)."""
    if dof <= len(T975):
        return T975[dof - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def t_interval(values: list[float]) -> tuple[float, list[float] | None]:
    """The mean of paired figures and its 95% t interval (mean ± t(n-1) x standard error); no interval of one."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, [mean - half, mean + half]


def ratio_interval(ratios: list[float]) -> tuple[float, list[float] | None]:
    """The geometric mean of paired ratios and its 95% interval: the t interval of their logs, back-transformed (a
    ratio's noise is multiplicative: 2x and 0.5x are equally far from 1x)."""
    mean, interval = t_interval([math.log(r) for r in ratios])
    return math.exp(mean), [math.exp(x) for x in interval] if interval else None


INTERVALS = ("paired t, 95%: a ratio is the geometric mean of its per-seed ratios to sync, its interval a t interval "
             "(n-1 degrees of freedom) on their logs, back-transformed; an accuracy difference is the mean of its "
             "per-seed differences to sync ± t x their standard error. Not a percentile bootstrap: over n pairs its "
             "percentiles lie within the pairs' min and max, which cover the median with probability 1 - 2 x 0.5^n "
             "(94% at 5 seeds, 75% at 3), so it cannot give 95% with the few seeds a run of these costs")


def ratio_figures(pairs: list[tuple[dict, dict]], key: str, label: str) -> dict:
    """sync / this over the pairs (`ratio_interval`) under `label`, with the pairs' [min, max] and how many pairs
    both have the figure; None unless every pair has it (a time to target only if both reached it in every seed)."""
    ratios = [b[key] / o[key] if b.get(key) and o.get(key) else None for b, o in pairs]
    whole = bool(ratios) and None not in ratios
    mean, interval = ratio_interval(ratios) if whole else (None, None)
    return {label: mean, f"{label}_ci95": interval, f"{label}_spread": [min(ratios), max(ratios)] if whole else None,
            f"{label}_pairs": sum(r is not None for r in ratios)}


def difference_figures(pairs: list[tuple[dict, dict]], key: str) -> dict | None:
    """this - sync of `key` over the pairs: the mean, its 95% t interval, the pairs (None unless every pair has it)."""
    diffs = [o[key] - b[key] for b, o in pairs if o.get(key) is not None and b.get(key) is not None]
    if not diffs or len(diffs) < len(pairs):
        return None
    mean, interval = t_interval(diffs)
    return {"diff": mean, "ci95": interval, "pairs": len(diffs)}


# name: (key, label) of each ratio to sync; a per-sample one always beside the per-token one and the trained lengths
RATIOS = (("per_sample", "time_per_sample_s"), ("per_token", "time_per_token_s"),
          ("time_to_target", "time_to_target_s"), ("per_sample_gpu_s", "gpu_s_per_sample"),
          ("per_token_gpu_s", "gpu_s_per_token"), ("time_to_target_gpu_s", "gpu_s_to_target"))
TARGET_SHARES = (0.25, 0.5, 0.75)  # of sync's gain over the run


def sync_targets(sync: list[dict]) -> dict[str, float | None]:
    """Targets set from sync's own runs. Its gain: per seed, its eval curve's last accuracy less its first; the
    median over seeds. gain_25, gain_50, gain_75: sync's median first accuracy plus 25, 50 and 75% of that gain.
    final_less_se: sync's final accuracy (the mean of its seeds' last evals) less one standard error
    (repeated_accuracy). A target at or below the first accuracy is None: every run would reach it at step 0."""
    curved = [r for r in sync if r.get("eval_curve")]
    if not curved:
        return {}
    start = statistics.median(r["eval_curve"][0][1] for r in curved)
    gain = statistics.median(r["eval_curve"][-1][1] - r["eval_curve"][0][1] for r in curved)
    final, se = repeated_accuracy([{**r, "final_accuracy": r["eval_curve"][-1][1]} for r in curved])
    targets = {**{f"gain_{round(100 * f)}": start + f * gain for f in TARGET_SHARES}, "final_less_se": final - se}
    return {name: accuracy if accuracy > start else None for name, accuracy in targets.items()}


TARGETS_HOW = ("set from sync's runs (rlsys.bench.sync_targets): gain_25/50/75 = sync's median first eval accuracy "
               "+ 25/50/75% of its median gain (per seed: last eval accuracy - first); final_less_se = the mean of "
               "sync's last eval accuracies - their standard error. GPU-seconds and samples to a target: where the "
               "eval curve first reaches it, interpolated linearly between evals")


def gpu_s_curve(run: dict) -> list[list[float]]:
    """The run's eval curve against GPU-seconds (its time x its GPU budget; its time where it had no budget)."""
    return [[t * (run.get("gpus") or 1), acc] for t, acc in run["eval_curve"]]


def add_targets(runs: dict[str, list[dict]]) -> dict[str, float | None]:
    """With sync among `runs`: its targets (sync_targets), and added to each run the GPU-seconds and the samples it
    took to reach each (gpu_s_to_<target>, samples_to_<target>: crossing on its eval curve, None if never), and its
    accuracy at the GPU-seconds its seed's sync run used to its last eval (accuracy_at_sync_gpu_s; None for a seed
    sync did not run). Before aggregating; {} without sync."""
    if not runs.get("sync"):
        return {}
    targets = sync_targets(runs["sync"])
    for rs in runs.values():
        for r in rs:
            cost = gpu_s_curve(r)
            samples = [[n, acc] for n, (_, acc) in zip(r.get("eval_samples") or [], r["eval_curve"])]
            for name, accuracy in targets.items():
                reachable = accuracy is not None
                r[f"gpu_s_to_{name}"] = crossing(cost, accuracy) if reachable else None
                r[f"samples_to_{name}"] = crossing(samples, accuracy) if reachable and samples else None
            r["accuracy_at_sync_gpu_s"] = None
        for b, o in paired(runs["sync"], rs):
            o["accuracy_at_sync_gpu_s"] = accuracy_at(o, gpu_s_curve(b)[-1][0], gpu_s=True) if b["eval_curve"] else None
    return targets


def speedups(runs: dict[str, list[dict]], results: dict, targets: dict | None = None) -> dict:
    """Each preset against sync, paired by seed (`paired`): ratios sync / this (`ratio_figures`, paired t intervals)
    per sample and per trained token, beside both presets' trained lengths (a per-sample ratio mixes speed with
    answer length), to the fixed target and to each of sync's targets in GPU-seconds and in samples; this - sync
    (`difference_figures`) of the final accuracy and of the accuracy at sync's GPU-seconds; the bubble ratio beside
    sync's; and whether the two ran on different GPU budgets (a wall-time ratio between budgets is not a
    like-for-like speedup). The final accuracy's difference of means (accuracy_difference) stays beside."""
    if "sync" not in runs:
        return {}

    out = {}
    keyed = RATIOS + tuple((f"{what}_to_{name}", f"{what}_to_{name}") for name in targets or {}
                           for what in ("gpu_s", "samples"))
    for name in runs:
        pairs = paired(runs["sync"], runs[name])
        mine, base = results[name], results["sync"]
        out[name] = {"pairs": len(pairs), "final_accuracy_vs_sync": accuracy_difference(mine, base),
                     "trained_length_sync_and_this": [base.get("trained_length"), mine.get("trained_length")]}
        for label, key in keyed:
            out[name].update(ratio_figures(pairs, key, label))
        out[name]["final_accuracy_paired"] = difference_figures(pairs, "final_accuracy")
        out[name]["accuracy_at_sync_gpu_s"] = difference_figures(pairs, "accuracy_at_sync_gpu_s")
        bubbles = [base.get("bubble_ratio"), mine.get("bubble_ratio")]
        out[name]["bubble_ratio_vs_sync"] = {  # SortedRL's measure: the medians' ratio, and the paired difference
            "sync_and_this": bubbles, "ratio": bubbles[1] / bubbles[0] if bubbles[0] and bubbles[1] is not None
            else None, "paired": difference_figures(pairs, "bubble_ratio")}
        gpus = [base.get("gpus"), mine.get("gpus")]
        out[name]["gpus_sync_and_this"] = gpus
        out[name]["budgets_differ"] = gpus[0] != gpus[1]
    return out


class RunCut(Exception):
    """A run stopped before its last step (Ctrl-C, SIGTERM): its folder holds the metrics rows it wrote."""

    def __init__(self, run_dir: Path):
        super().__init__(f"{run_dir} was stopped before its last step")
        self.run_dir = run_dir


def budget_gpus(cfg: Config) -> int | None:
    """The GPUs a run pays for: its emulated budget, or its placement plan's; None on the CPU."""
    if cfg.emulate.on:
        return Budget.of_run(cfg).gpus
    plan = plan_from_config(cfg)
    return plan.used_gpus if plan else None


def run_config(config: str | None, overrides: list[str], out_dir: Path) -> Config:
    """The config of one run of a sweep, in `out_dir`, without a progress bar."""
    return load_config(config, overrides + [f"output_dir={out_dir}", "logging.progress=false"])


def run_loaded(cfg: Config, controller_class=None) -> list[dict]:
    """The metrics rows of a run of `cfg` (run_config's) in a fresh cfg.output_dir; a run stopped before its end
    raises RunCut, so no sweep takes it for a whole one."""
    from rlsys.train import Controller, train

    out_dir = Path(cfg.output_dir)
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    final = train(cfg, controller_class=controller_class or Controller)
    if final["stopped"]:
        raise RunCut(out_dir)
    return read_metrics(out_dir)


def run_preset(config: str | None, overrides: list[str], out_dir: Path, controller_class=None) -> list[dict]:
    """One run's metrics rows (run_loaded)."""
    return run_loaded(run_config(config, overrides, out_dir), controller_class)


def claim_out_dir(out_dir: Path, top_up: bool) -> None:
    """A bench replaces the run folders of the presets it runs: refuse a folder that holds another bench's runs,
    unless --top-up says this bench adds to it."""
    if top_up or not out_dir.is_dir():
        return
    held = sorted(p.name for p in out_dir.iterdir())
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UserError(f"--out-dir {out_dir} holds an earlier bench's runs ({shown}); choose another folder with "
                        "--out-dir DIR, or remove it (--top-up adds to it, replacing only the presets run now)")


def claim_output(output: str | None, top_up: bool) -> None:
    """A report is rewritten after every run: refuse to replace an earlier bench's unless --top-up adds to it."""
    if output and not top_up and Path(output).exists():
        raise UserError(f"--output {output} holds an earlier bench's report; give another --output, or remove it "
                        "(--top-up adds to it, replacing only the presets run now)")


def kept_runs(output: str | None, workload: dict, presets: list[str], cfg: Config) -> dict[str, list[dict]]:
    """--top-up: the runs of `output`'s other presets, measured on the same workload from the model this
    machine builds for `cfg` (else a UserError)."""
    if not output or not Path(output).exists():
        return {}
    before = json.loads(Path(output).read_text())
    differs = [k for k in ("config", "overrides", "target") if before["workload"].get(k) != workload[k]]
    if differs:
        raise UserError(f"--top-up: {output} was measured on another workload ({', '.join(differs)}: "
                        f"{', '.join(repr(before['workload'].get(k)) for k in differs)}); give the same, or another --output")
    kept = {name: rs for name, rs in before["runs"].items() if name not in presets}
    why = started_elsewhere([r for rs in kept.values() for r in rs], cfg)
    if why:
        raise UserError(f"--top-up: {output}: {why}; give another --output, or top it up where it was measured")
    return kept


def bench(config: str, overrides: list[str], presets: list[str], repeats: int, target: Target,
          out_dir: Path, output: str | None = None, vary_seed: bool = False, top_up: bool = False) -> dict:
    """The report; with `output`, rewritten there after every run, so a sweep cut short keeps what it measured.
    `vary_seed`: repeat r runs with seed=r (training noise), else every repeat with the config's seed.
    `top_up`: the report keeps `output`'s runs of the presets not run now. A run cut short (Ctrl-C, SIGTERM)
    stops the bench: the report keeps the runs that finished and lists the cut one under "cut_runs", compared
    with nothing, and says "interrupted"."""
    claim_out_dir(out_dir, top_up)
    claim_output(output, top_up)
    names = [p for p in presets if available(p)]
    skipped = [p for p in presets if p not in names]
    if skipped:
        print(f"skipping presets not available yet: {', '.join(skipped)}")
    cfg = load_config(config, overrides)
    same = changing_nothing(cfg, config, overrides, names)
    if same:
        print(f"skipping presets that change nothing on this workload: {', '.join(same)}")
        names = [p for p in names if p not in same]
    workload = {"config": os.path.relpath(config or DEFAULT_CONFIG), "overrides": overrides, "target": str(target)}
    kept = kept_runs(output, workload, names, cfg) if top_up else {}
    runs: dict[str, list[dict]] = {**kept, **{n: [] for n in names}}
    cut: dict[str, dict] = {}  # the run a Ctrl-C stopped, by its folder's name

    def report() -> dict:
        done = {n: v for n, v in runs.items() if v}
        equal_time_s = add_equal_time(done) if done else None
        targets = add_targets(done)
        results = {n: aggregate(v) for n, v in done.items()}
        return {
            "workload": {**workload,
                         "target_accuracy": median_of([r for rs in done.values() for r in rs], "target_accuracy"),
                         "model": cfg.model.model_dump(include={"arch", "hidden_size", "num_layers", "path"}),
                         "task": cfg.data.task, "seed": cfg.seed, "prompts_per_step": cfg.control.prompts_per_step,
                         "group_size": cfg.control.group_size, "total_steps": cfg.trainer.total_steps,
                         "max_new_tokens": cfg.rollout.max_new_tokens, "slots": cfg.rollout.slots,
                         "clock": clock_label(cfg.emulate),
                         **({"emulate": cfg.emulate.model_dump()} if cfg.emulate.on else {})},
            "machine": machine(),
            "equal_time_s": equal_time_s,
            "targets": targets, "targets_how": TARGETS_HOW, "intervals": INTERVALS,
            "results": results,
            "speedup_vs_sync": speedups(done, results, targets),
            "runs": done,
            **({"interrupted": True, "cut_runs": cut} if cut else {}),
        }

    order = [(r, name) for r in range(repeats)  # rotated so no preset always runs first
             for name in names[r % len(names):] + names[: r % len(names)]]
    for r, name in order:
        t, run_dir = time.time(), out_dir / f"{name}-r{r}"
        seed = [f"seed={r}"] if vary_seed else []
        run_cfg = run_config(config, overrides + preset_overrides(name) + seed, run_dir)
        gpus = budget_gpus(run_cfg)
        try:
            rows = run_loaded(run_cfg)
        except (RunCut, KeyboardInterrupt):  # one Ctrl-C stops the bench, not only this run
            rows = read_metrics(run_dir)
            steps = [row["step"] for row in rows if "timing/train_s" in row]
            cut[run_dir.name] = {"cut": True, "steps_trained": steps[-1] if steps else 0,
                                 **summarise_run(rows, target, gpus)}
            print(f"[bench] {name} repeat {r} was cut at step {cut[run_dir.name]['steps_trained']}: the bench "
                  "stops; the report keeps the runs that finished", flush=True)
            write_report(output, report())
            break
        runs[name].append(summarise_run(rows, target, gpus))
        print(f"[bench] {name} repeat {r}: {time.time() - t:.0f}s, "
              f"final accuracy {runs[name][-1]['final_accuracy']}", flush=True)
        write_report(output, report())
    return report()


def cell(result: dict, key: str, fmt: str) -> str:
    """A table cell; an accuracy with its standard error where the result has one."""
    if result.get(key) is None:
        return "-"
    se = result.get(f"{key}_se")
    return fmt.format(result[key]) + (f"±{se:.3f}" if se is not None else "")


def times(x: float | None, interval: list[float] | None = None) -> str:
    """A ratio as 1.23x, with its 95% interval where there is one."""
    if x is None:
        return "-"
    return f"{x:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def print_table(report: dict) -> None:
    print(f"times in {report['workload'].get('clock', 'wall')} seconds; GPU-s: time x the run's GPU budget")
    cols = [("gpus", "GPUs", "{:.0f}"), ("step_time_s", "step s", "{:.2f}"), ("time_per_sample_s", "s/sample", "{:.4f}"),
            ("gpu_s_per_sample", "GPU-s/smp", "{:.4f}"), ("trained_length", "trained len", "{:.1f}"),
            ("gpu_s_per_token", "GPU-s/tok", "{:.2e}"),
            ("bubble_ratio", "bubble", "{:.3f}"), ("straggler_rate", "straggler", "{:.2f}"),
            ("efficiency", "effic.", "{:.2f}"), ("tokens_per_s", "tok/s", "{:.0f}"),
            ("time_to_target_s", "to target s", "{:.0f}"), ("gpu_s_to_target", "GPU-s to tgt", "{:.0f}"),
            ("final_accuracy", "final acc", "{:.3f}"),
            ("accuracy_at_equal_time", "acc @ T", "{:.3f}"), ("group_size", "G", "{:.1f}")]
    # a per-sample speedup is printed beside the per-token one and the two presets' trained lengths
    print(f"{'preset':<16}" + "".join(f"{h:>13}" for _, h, _ in cols)
          + f"{'speedup':>10}{'per GPU-s':>11}{'per tok GPU-s':>15}{'len sync/this':>15}")
    marked = False
    for name, r in report["results"].items():
        cells = "".join(f"{cell(r, k, f):>13}" for k, _, f in cols)
        versus = report["speedup_vs_sync"].get(name, {})
        mark = " *" if versus.get("budgets_differ") else ""
        marked |= bool(mark)
        s, g, t = versus.get("per_sample"), versus.get("per_sample_gpu_s"), versus.get("per_token_gpu_s")
        lengths = "/".join(f"{x:.1f}" if x is not None else "-" for x in versus.get("trained_length_sync_and_this", []))
        print(f"{name:<16}{cells}{times(s) + mark:>10}{times(g):>11}{times(t):>15}{lengths or '-':>15}")
    if marked:
        print("* on a different GPU budget than sync: its wall-time speedup is not at equal GPUs; see per GPU-s")
    if report.get("equal_time_s"):
        print(f"acc @ T: eval accuracy at T = {report['equal_time_s']:.0f} s of training (the shortest run)")
    print_targets(report)


def print_targets(report: dict) -> None:
    """Each preset against sync's own targets: GPU-seconds to each (sync's / this, paired by seed), samples to its
    final accuracy, accuracy at sync's GPU-seconds and the bubble ratio against sync's."""
    targets = {k: v for k, v in (report.get("targets") or {}).items() if v is not None}
    if not targets:
        return
    print("\nsync's targets: " + ", ".join(f"{k} {v:.3f}" for k, v in targets.items())
          + "; ratios sync / this with 95% paired t intervals (>1x: this is cheaper)")
    sampled = "final_less_se" in targets  # SortedRL's measure: samples to reach sync's final accuracy
    heads = [f"GPU-s to {k}" for k in targets] + ["samples to final_less_se"] * sampled + ["acc @ sync GPU-s",
                                                                                          "bubble / sync"]
    print(f"{'preset':<16}{'pairs':>6}" + "".join(f"{h:>26}" for h in heads))
    for name, v in report["speedup_vs_sync"].items():
        if name == "sync":
            continue
        at = v.get("accuracy_at_sync_gpu_s")
        gap = "-" if not at else f"{at['diff']:+.3f}" + (f" [{at['ci95'][0]:+.3f}, {at['ci95'][1]:+.3f}]"
                                                         if at["ci95"] else "")
        bubble = v.get("bubble_ratio_vs_sync", {}).get("ratio")
        cells = [times(v.get(f"gpu_s_to_{k}"), v.get(f"gpu_s_to_{k}_ci95")) for k in targets]
        cells += [times(v.get("samples_to_final_less_se"), v.get("samples_to_final_less_se_ci95"))] * sampled
        cells += [gap, f"{bubble:.2f}" if bubble is not None else "-"]
        print(f"{name:<16}{v['pairs']:>6}" + "".join(f"{c:>26}" for c in cells))
    print(f"intervals: {report.get('intervals', INTERVALS)}")


def plot_bench(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlsys.plot import draw_accuracy, draw_timeline

    names = list(report["results"])
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        for r in range(report["results"][name]["repeats"]):
            draw_accuracy(ax, read_jsonl(out_dir / f"{name}-r{r}" / "metrics.jsonl"), color=colors[name], alpha=0.8,
                          label=name if r == 0 else None)
    target = report["workload"]["target_accuracy"]
    ax.axhline(target, ls="--", color="grey", lw=1, label=f"target accuracy {target:.3f}")
    clock = report["workload"].get("clock", "wall")
    ax.set(xlabel=f"training {clock} time (s)", ylabel="eval accuracy (± standard error)",
           title=f"Accuracy against {clock} time")
    ax.legend(), ax.grid(alpha=0.3)
    paths = [out_dir / "accuracy_vs_time.png"]
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    med = [report["results"][n]["bubble_ratio"] for n in names]
    spread = [report["results"][n].get("bubble_ratio_spread", [m, m]) for n, m in zip(names, med)]
    ax.bar(names, med, color=[colors[n] for n in names],
           yerr=[[m - s[0] for m, s in zip(med, spread)], [s[1] - m for m, s in zip(med, spread)]])
    ax.set(ylabel="rollout/bubble_ratio", title="Bubble ratio per preset (median, min-max)")
    paths.append(out_dir / "bubble_ratio.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    # A preset kept by --top-up may have its runs under another --out-dir: its timeline is not drawn here.
    timelines = {n: rows for n in names if (rows := read_jsonl(out_dir / f"{n}-r0" / "timeline.jsonl"))}
    fig, axes = plt.subplots(1, max(1, len(timelines)), figsize=(5 * max(1, len(timelines)), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], timelines.items()):
        steps = sorted({x["step"] for x in rows})
        shown = steps[len(steps) // 2: len(steps) // 2 + 3]  # three steps from the middle of the run
        draw_timeline(ax, [x for x in rows if x["step"] in shown], f"{name}: steps {shown[0]}-{shown[-1]}",
                      f"training {clock} time (s)")
    paths.append(out_dir / "timelines.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of runs, at least 1")
    return int(text)


def add_arguments(p) -> None:
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help=f"the workload: a config (default {DEFAULT_CONFIG.name}) and overrides")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help="comma-separated presets, two joined by + combine (default: all available)")
    p.add_argument("--repeats", type=positive_int, default=2, help="runs per preset, interleaved (default 2)")
    p.add_argument("--target", type=Target.parse, default=Target.parse(DEFAULT_TARGET),
                   help="eval accuracy for time-to-target (0.3), or a gain over each run's first eval "
                        f"(+0.025; default {DEFAULT_TARGET})")
    p.add_argument("--vary-seed", action="store_true", help="repeat r runs with seed=r")
    p.add_argument("--quick", action="store_true", help="a short workload: " + " ".join(QUICK))
    p.add_argument("--out-dir", default="runs/bench",
                   help="where the runs and figures go: a new or empty folder (or, with --top-up, the earlier one)")
    p.add_argument("--output", help="write the report JSON here: a new file (an earlier report only with --top-up)")
    p.add_argument("--top-up", action="store_true",
                   help="keep --output's runs of the presets not given, measured on the same workload")


def run_from_args(args) -> int:
    config, overrides = split_config_and_overrides(args.items)
    overrides = (QUICK if args.quick else []) + overrides
    out_dir = Path(args.out_dir)
    report = bench(config, overrides, args.presets.split(","), args.repeats, args.target, out_dir, args.output,
                   args.vary_seed, args.top_up)
    print_table(report)
    paths = []
    if report["results"]:
        try:  # matplotlib is optional: offline GPU hosts go without it (benchmarks/gpu/build_bundle.py)
            paths = plot_bench(report, out_dir)
        except ModuleNotFoundError as e:
            print(f"no plots: {e.name} is not installed")
    for path in paths:
        print(f"wrote {path}")
    if args.output:
        print(f"wrote {args.output}")
    if report.get("interrupted"):
        print(f"rlsys: bench interrupted: {', '.join(report['cut_runs'])} was cut and is left out of the table; "
              f"the finished runs are in {out_dir}", file=sys.stderr)
        return 130
    return 0
