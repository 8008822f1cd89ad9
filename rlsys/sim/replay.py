"""The simulator fed a live run's own response lengths, to check it against the live system on an emulated
clock (rlsys/emulate.py): same schedule, same cost model, the lengths the run's engines produced.

`replay_config(run_dir)` turns a live run's config into the simulator's (the emulated GPU and model, the
engines' slots, the trainer's GPUs, the schedule) and its `timeline.jsonl` into a `Replay` workload: the
prompt the simulator draws j-th answers with the lengths of the run's j-th prompt, each token k tokens of the
emulated model. Rewards and reward latencies stay the simulator's own draws.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from rlsys import costs
from rlsys.config import Config, read_config
from rlsys.data.cursor import PromptCursor
from rlsys.emulate import Budget
from rlsys.logger import read_jsonl
from rlsys.memory import built_model_shape
from rlsys.sim.config import SimConfig, load_sim_config
from rlsys.sim.workload import SampleDraw, Workload
from rlsys.types import Prompt


class Replay(Workload):
    """A workload whose j-th drawn prompt's i-th request answers with the length of the run's j-th prompt's i-th
    (`lengths`, from `live_lengths`), whatever the sample:
    the simulator's cursor shuffles its prompts with the run's seed, so prompt j goes where that shuffle draws
    j-th, and each step trains the prompts its live step did."""

    def __init__(self, cfg: SimConfig, lengths: list[list[tuple[int, bool]]]):
        super().__init__(cfg.workload, cfg.reward, cfg.seed)
        drawn = PromptCursor(list(range(len(lengths))), seed=cfg.seed).take(len(lengths))
        self.lengths = [[] for _ in lengths]
        for j, index in enumerate(drawn):
            self.lengths[index] = lengths[j]

    def samples(self, prompt: Prompt, first: int, n: int, runaways: int = 0) -> list[SampleDraw]:
        """The live requests' lengths, whatever ran away before: the live run's lengths say what regenerating did."""
        return [self._replayed(d, prompt, first + j) for j, d in enumerate(super().samples(prompt, first, n))]

    def resumed(self, prompt: Prompt, ordinal: int, done: int, cut: SampleDraw) -> SampleDraw:
        draw = self._replayed(cut, prompt, ordinal)
        length = min(self.spec.max_tokens, max(draw.length, done + 1))
        return draw._replace(length=length, truncated=length >= self.spec.max_tokens)

    def _replayed(self, draw: SampleDraw, prompt: Prompt, ordinal: int) -> SampleDraw:
        known = self.lengths[prompt.index]  # (tokens, finished) of the prompt's live requests, in submission order
        finished = [n for n, done in known if done] or [max(n for n, _ in known) + 1]
        if ordinal < len(known):
            n, done = known[ordinal]
            # Aborted live (a tail extra, a sorted round's unfinished sample): longer than its partial output,
            # and, its prompt's other samples having finished first, taken as long as their longest.
            length = n if done else max(n + 1, *finished)
        else:  # a request the live run never made
            length = finished[ordinal % len(finished)]
        length = min(length, self.spec.max_tokens)
        truncated = length >= self.spec.max_tokens
        return draw._replace(length=length, truncated=truncated, reward=0.0 if truncated else draw.reward)


def live_lengths(timeline: list[dict], k: int) -> tuple[list[list[tuple[int, bool]]], float]:
    """Per prompt, in the order the run drew them (its first request's number; request ids are
    "<prompt uid>#<n>", n counting the run's requests): its requests in submission order as (tokens times k,
    finished), an aborted one's tokens its partial output; and the mean prompt length times k."""
    by_prompt: dict[str, list[tuple[int, int, bool]]] = {}
    prompt_tokens = []
    for row in timeline:
        uid, n = row["request_id"].rsplit("#", 1)
        by_prompt.setdefault(uid, []).append((int(n), k * row["tokens"], row["finish_reason"] != "abort"))
        prompt_tokens.append(k * row["prompt_tokens"])
    ordered = sorted(by_prompt.values(), key=min)
    return ([[(tokens, done) for _, tokens, done in sorted(requests)] for requests in ordered],
            statistics.mean(prompt_tokens))


def replay_config(run_dir: str | Path, steps: int | None = None, gpu: str | None = None,
                  engine: dict | None = None) -> tuple[SimConfig, Replay]:
    """The simulator's config and workload for the live emulated run in `run_dir`; or, given the `gpu` it ran on,
    for a run on one real GPU with the built-in engine (its model by shape, the engine's cost `engine`: a
    costs.BUILTIN_ENGINE-like profile, colocated)."""
    run_dir = Path(run_dir)
    live: Config = read_config(run_dir / "config.yaml")[0]  # its values only: nothing of it runs
    e = live.emulate
    if gpu:
        model = dataclasses.asdict(built_model_shape(live))
        profile = engine or costs.BUILTIN_ENGINE
        engine_spec = {"step_overhead_ms": profile["overhead_s"] * 1e3, "decode_mfu": profile["decode_mfu"],
                       "prefill_mfu": profile["prefill_mfu"], "padded_key_us": profile.get("key_s", 0.0) * 1e6}
        # colocated resident: the built-in engine keeps its weights through a sleep (rlsys/rollout/builtin_engine.py)
        e = e.model_copy(update={"gpu": gpu, "tp": 1, "gpus": live.rollout.num_workers, "layout": "colocated",
                                 "tokens_per_token": 1, "colocation": "resident"})
    elif not e.on:
        raise ValueError(f"{run_dir}: not an emulated run (emulate.gpu is unset in its config.yaml)")
    else:
        model, engine_spec = e.model, {}
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    if not timeline:
        raise ValueError(f"{run_dir}: timeline.jsonl is empty or missing")
    k = e.tokens_per_token
    lengths, prompt_tokens = live_lengths(timeline, k)
    # The run's GPU budget, laid out as the live run's (rlsys/emulate.py Budget): colocated, the trainer holds every
    # GPU while it trains and the engines wait (the simulator pauses them, as the live GPUTimeline makes them wait),
    # and a streamed batch takes every GPU too (trainer.contend) unless trainer.scale_down_at lends it the GPUs of
    # the engines scaled down; separate, the trainer has the GPUs the engines leave.
    budget = (Budget.of(e, live.rollout.num_workers, live.trainer.world_size, zero_stage=None) if gpu  # it ran: fit
              else Budget.of_run(live.model_copy(update={"emulate": e})))
    if budget.layout == "colocated" and budget.gpus != e.tp * len(budget.engines):
        raise ValueError(f"{run_dir}: emulate.gpus={budget.gpus} colocated with rollout.num_workers="
                         f"{len(budget.engines)} x emulate.tp={e.tp} leaves GPUs without an engine, which the "
                         "simulator (an engine on every colocated GPU) does not model")
    cluster = ({"gpus": budget.gpus, "colocation": e.colocation} if budget.layout == "colocated"
               else {"gpus": budget.gpus, "trainer_gpus": len(budget.trainer)})
    # The live trainer's passes per token: forward and backward; a forward more against a KL reference; and where
    # samples may be stale (partial rollouts, async), pi_prox recomputed for every mini-batch but the first.
    t = live.trainer
    c = live.control
    stale = c.scheduler == "async" or (c.scheduler == "sorted" and c.sorted.mode == "partial")
    recompute = stale and t.proximal == "recompute" and t.mini_batches > 1
    flops = (costs.TRAIN_FLOPS + (costs.FORWARD_FLOPS if t.kl.enabled else 0)
             + (costs.FORWARD_FLOPS * (t.mini_batches - 1) / t.mini_batches if recompute else 0))
    cfg = load_sim_config({
        "name": f"replay of {run_dir.name}", "seed": live.seed,
        "steps": steps or max(r["step"] for r in timeline),
        "schedulers": [live.control.scheduler], "model": model,
        "cluster": {"gpu": e.gpu, "tp": e.tp, **cluster},
        # the live bubble ratio's capacity is every slot of every engine (rlsys/rollout/manager.py), so the replay's too
        "engine": {"max_seqs": live.rollout.slots, "bubble_slots": live.rollout.slots, **engine_spec},
        "workload": {"max_tokens": k * live.rollout.max_new_tokens, "prompt_tokens": prompt_tokens,
                     "max_prompt_tokens": k * live.data.max_prompt_tokens, "dataset_size": len(lengths)},
        "trainer": {"flops_per_param_token": flops, "overhead_s": 0.0, "streamed": t.streamed,
                    "scale_down_at": t.scale_down_at, "contend": budget.layout == "colocated",
                    "zero_stage": t.zero_stage},
        "control": c.model_dump(),
    })
    return cfg, Replay(cfg, lengths)


# figure -> (live metric, simulator's figure): both bubbles over the steps' rollout windows (rlsys/step_stats.py)
FIGURES = {"step_time_s": ("timing/step_s", "step_time_s"), "rollout_time_s": ("timing/rollout_s", "rollout_time_s"),
           "bubble_ratio": ("rollout/bubble_ratio", "rollout_bubble_ratio")}


def live_vs_sim(run_dir: str | Path, **replay) -> dict:
    """A live run's step time, rollout time and bubble ratio beside the simulator's for the same lengths and
    schedule (`replay`: replay_config's gpu and engine, for a run on a real GPU)."""
    from rlsys.sim.simulator import Simulation

    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    steps = [r for r in rows if "timing/step_s" in r]
    cfg, workload = replay_config(run_dir, steps=len(steps), **replay)
    sim = Simulation(cfg, cfg.runs()[0], workload).run()
    out = {}
    for figure, (key, sim_key) in FIGURES.items():
        live = statistics.mean(r[key] for r in steps)
        if figure == "bubble_ratio":  # the simulator's is over all windows together, so the steps' weighted by theirs
            live = sum(r[key] * r["timing/rollout_s"] for r in steps) / sum(r["timing/rollout_s"] for r in steps)
        out[figure] = {"live": live, "sim": sim[sim_key], "sim_over_live": sim[sim_key] / live if live else None}
    # GPU-seconds per trained sample over the steps' time, on the run's budget (the same in both)
    out["gpus"] = gpus = cfg.cluster.gpus
    if all("samples" in r for r in steps):
        live = gpus * sum(r["timing/step_s"] for r in steps) / sum(r["samples"] for r in steps)
        simulated = gpus * sim["sim_time_s"] / sim["trained_samples"]
        out["gpu_s_per_sample"] = {"live": live, "sim": simulated, "sim_over_live": simulated / live}
    final = rows[-1]
    out["overrun_share"] = final.get("emulate/overrun_share")
    out["emulating"] = final.get("emulate/emulating")
    out["live_train_time_s"] = statistics.mean(r["timing/train_s"] for r in steps)
    out["sim_train_time_s"] = sim["train_time_s"]
    out["live_weight_sync_s"] = statistics.mean(r["timing/weight_sync_s"] for r in steps)
    out["sim_weight_sync_s"] = sim["weight_sync_s"]
    # what a live step spent outside its rollout window, reward wait, training and weight publish: unpaced work
    out["live_unaccounted_s"] = statistics.mean(r["timing/step_s"] - sum(r[f"timing/{part}_s"] for part in
                                                ("rollout", "reward", "train", "weight_sync")) for r in steps)
    return out
