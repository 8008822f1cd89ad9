"""Per-step rollout measurements: what the engines did between a step's first submit and its training."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from rlsys.control.metrics import idle_share, percentile, straggler_rate
from rlsys.types import Completion, Group, ScoredSample

EngineStats = Callable[[tuple[float, float]], list[dict]]  # the engines' stats, occupancy of a window included


class StepStats:
    def __init__(self, kappa: float, capacity: int, engine_stats: EngineStats,
                 step_clock: Callable[[], float] | None = None):
        self.kappa, self.capacity, self.engine_stats = kappa, capacity, engine_stats
        # step_s is read on it; the controller's training clock leaves eval and checkpoints out
        self.step_clock = step_clock or (lambda: time.time())
        step_clock = self.step_clock
        self.completions: list[Completion] = []
        self.finished: list[Completion] = []  # the last handed-over step's, for its totals and timeline
        self.t_handover = time.time()  # the last handover to training
        self.t_step = step_clock()  # the last weights publish
        self.start_step()

    def start_step(self) -> None:
        """A new rollout window opens (`rollout_opens`)."""
        carried = self.completions  # collected after the handover: they count in this step
        # Samples that finished just before the handover (collected late) and aborted extras do not count.
        last_finish = max((c.end_time for c in carried if c.finish_reason != "abort"), default=self.t_handover)
        self.t_start = rollout_opens(time.time(), self.t_handover, last_finish)
        self.t_last_completion = max([self.t_start] + [c.end_time for c in carried])
        self.requests = 0
        self.reward_errors = 0

    def submitted(self, n: int) -> None:
        self.requests += n

    def add_completion(self, completion: Completion) -> None:
        self.completions.append(completion)
        self.t_last_completion = time.time()

    def add_reward(self, error: str | None) -> None:
        self.reward_errors += error is not None

    def close_rollout(self, groups: list[Group]) -> dict[str, float]:
        """Metrics of the rollout phase, called when the scheduler hands over the groups to train.

        The bubble ratio is read from the engines' own step records over the window, so requests still
        generating or cut at the handover (sorted, tail, async) count as busy, not only finished ones."""
        now = self.t_handover = time.time()
        end = max([c.end_time for c in self.completions] + [self.t_start])
        engines = self.engine_stats((self.t_start, end))
        saturated_tokens_per_s = sum(e.get("saturated_tokens_per_s") or 0.0 for e in engines)
        occupied = sum(e["occupied_slot_s"] for e in engines)
        rollout_s = self.t_last_completion - self.t_start
        lengths = [n for g in groups for n in g.lengths]
        rewards = [r for g in groups for r in g.rewards]
        engine_window = max(end - self.t_start, 1e-9)
        generated = sum(c.num_tokens for c in self.completions)
        in_window = tokens_within(self.completions, self.t_start, end)
        pace = engine_pace(engines, end - self.t_start)
        done, self.finished, self.completions = self.completions, self.completions, []  # later: next step's
        return {
            "samples": len(lengths),
            "prompts": len(groups),
            "group_size": statistics.mean(len(g.samples) for g in groups) if groups else 0,
            "reward/mean": statistics.mean(rewards) if rewards else 0.0,
            "reward/step_errors": self.reward_errors,
            "response_length/mean": statistics.mean(lengths) if lengths else 0.0,
            "response_length/max": max(lengths, default=0),
            "response_length/p99": percentile(lengths, 99),
            # the length shape: its middle, its tail, and the share cut at the response cap
            "response_length/p50": percentile(lengths, 50),
            "response_length/p90": percentile(lengths, 90),
            "response_length/at_cap": (statistics.mean(s.completion.finish_reason == "length" for g in groups
                                                       for s in g.samples) if lengths else 0.0),
            # beside the responses' tokens: the prompts' share of what trains (rlsys.bench.length_shape)
            "prompt_length/mean": (statistics.mean(len(s.completion.prompt_ids) for g in groups for s in g.samples)
                                   if lengths else 0.0),
            "rollout/bubble_ratio": idle_share(occupied, self.capacity * engine_window),
            "rollout/straggler_rate": straggler_rate([g.lengths for g in groups], self.kappa),
            "rollout/efficiency": (in_window / (saturated_tokens_per_s * engine_window)
                                   if saturated_tokens_per_s else 0.0),
            "rollout/decode_steps": pace["decode_steps"],
            "rollout/decode_step_ms": pace["decode_step_ms"],
            "rollout/engine_busy_share": pace["busy_share"],
            "rollout/generated_tokens": generated,
            "rollout/aborted": sum(c.finish_reason == "abort" for c in done),
            **tool_metrics([s.completion for g in groups for s in g.samples]),
            **reward_part_means([s for g in groups for s in g.samples]),
            "timing/rollout_s": rollout_s,
            "timing/reward_s": now - self.t_last_completion,  # reward time not hidden behind generation
        }

    def step_totals(self) -> dict[str, float]:
        """Called once the step's weights are published: its full wall time and token throughput."""
        now = self.step_clock()
        step_s, self.t_step = now - self.t_step, now  # publish to publish: overlapped training counts once
        generated = sum(c.num_tokens for c in self.finished)
        return {"timing/step_s": step_s, "throughput/tokens_per_s": generated / max(step_s, 1e-9)}

    def generating_share(self, start: float, end: float) -> float:
        """The share of [start, end] the engines spent decoding, averaged over engines: during a train step, how
        much rollout overlapped it (0 in sync; the asynchronous schedule's aim is 1)."""
        engines = self.engine_stats((start, end))
        busy = sum(e.get("busy_s_in_window", 0.0) for e in engines)
        return busy / max((end - start) * len(engines), 1e-9) if engines else 0.0

    def timeline_rows(self, step: int, t0: float, scale: float = 1.0) -> list[dict]:
        """Times in seconds since t0, over `scale` (emulate.time_scale: the run's emulated seconds)."""
        return [{"step": step, "request_id": c.request_id, "worker": c.worker, "slot": c.slot,
                 "start": round((c.start_time - t0) / scale, 4), "end": round((c.end_time - t0) / scale, 4),
                 "tokens": c.num_tokens, "prompt_tokens": len(c.prompt_ids), "finish_reason": c.finish_reason}
                for c in self.finished]


def rollout_opens(boundary: float, handover: float, last_finish: float) -> float:
    """Where a step's rollout window opens, for the live run and the simulator alike: at the step boundary (the
    last weights published), or, where the engines went on generating through the train step (a sample finished
    after the last handover to training: sorted, async), at that handover."""
    return handover if last_finish > handover else boundary


def engine_pace(engines: list[dict], window_s: float) -> dict[str, float]:
    """How the engines spent a wall-clock window (their stats over it): their decode steps, their own time per
    step, and the share of the window they spent stepping. A slow step is the step itself (its device, its CPU); a fast step
    with a low share while requests wait is the generation thread kept from stepping (CPU, GIL)."""
    steps = sum(e["decode_steps_in_window"] for e in engines)
    busy = sum(e["busy_s_in_window"] for e in engines)
    return {"decode_steps": steps, "decode_step_ms": 1000 * busy / steps if steps else 0.0,
            "busy_share": busy / (window_s * len(engines)) if engines and window_s > 0 else 0.0}


def tool_metrics(completions: list[Completion]) -> dict[str, float]:
    """Of the samples handed to training (a conversation's partials carry their turns on, so each call counts
    once): tool calls made, how many failed, samples dropped for a failure (tools.on_failure=drop), tool
    calls per conversation, and an environment's mean reward per call (tools.env)."""
    calls = [t for c in completions for t in c.turns]
    return {"rollout/tool_calls": len(calls), "rollout/tool_failures": sum(not t.ok for t in calls),
            "rollout/tool_dropped": sum(bool(c.mask) and not any(c.mask) for c in completions),
            "rollout/turns": len(calls) / len(completions) if completions else 0.0,
            "rollout/turn_reward": statistics.mean(t.reward for t in calls) if calls else 0.0}


def reward_part_means(samples: list[ScoredSample]) -> dict[str, float]:
    """reward/<part>/mean of each reward.fn part over the samples that train (where it names several): each
    function's own value, before its weight; a sample that got the fallback reward has none."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for key, value in (s.reward_parts or {}).items():
            values.setdefault(key, []).append(value)
    return {f"reward/{key}/mean": statistics.mean(v) for key, v in values.items()}


def tokens_within(completions: list[Completion], start: float, end: float) -> float:
    """Generated tokens that fall in [start, end], spreading each request's tokens evenly over its run:
    a request that began before the window (async, sorted) counts only for its share inside it."""
    total = 0.0
    for c in completions:
        duration = c.end_time - c.start_time
        inside = min(c.end_time, end) - max(c.start_time, start)
        total += c.num_tokens if duration <= 0 else c.num_tokens * max(0.0, min(inside, duration)) / duration
    return total
