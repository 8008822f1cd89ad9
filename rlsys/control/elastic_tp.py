"""Elastic rollout parallelism: the engines' tensor-parallel size, chosen between rounds (after RollPacker's
parallelism planner; both rules are ours). `plan_tp` (rule "round", the simulator's default) picks, before a
round starts, the size the cost model finishes that round soonest with, from the round's type and expected
lengths. `ElasticTP` (rule "preemptions") reacts to the last round's KV-cache preemptions:

A preempted sequence loses its KV cache and is recomputed later, so preemptions mean the engines hold
more live tokens than their KV memory. Doubling TP halves the engines but more than doubles each
engine's KV room (the weights are split too), so every sequence gets more cache; halving TP gives back
engines, hence decode throughput, when the cache is not the limit.

After each round, rate = preemptions / requests of the round:
  rate > raise_at and TP < max:           the next larger size, at once (preemptions stall the batch);
  rate <= lower_at for `need_calm` rounds: the next smaller size;
a raise within `need_calm` rounds of a lowering doubles `need_calm` (up to BACKOFF_CAP x calm_rounds),
so a workload on the edge does not flip TP every few rounds.
"""
from __future__ import annotations

import math

BACKOFF_CAP = 16


def tp_sizes(min_tp: int, max_tp: int) -> list[int]:
    sizes, tp = [], 1
    while tp <= max_tp:
        if tp >= min_tp:
            sizes.append(tp)
        tp *= 2
    return sizes


class ElasticTP:
    def __init__(self, cfg, tp: int, allowed: list[int] | None = None):
        """`cfg` is a control.elastic_tp section; `allowed` narrows the sizes (e.g. to those dividing the
        rollout GPUs and fitting the model); `tp` is the size the engines start with."""
        self.cfg = cfg
        self.allowed = sorted(allowed if allowed is not None else tp_sizes(cfg.min_tp, cfg.max_tp))
        if tp not in self.allowed:
            raise ValueError(f"control.elastic_tp: the starting TP size {tp} is not one of {self.allowed} "
                             "(powers of two from min_tp to max_tp that fit the cluster)")
        self.tp = tp
        self.calm = 0  # calm rounds in a row
        self.need_calm = cfg.calm_rounds
        self.since_lower: int | None = None  # rounds since the last lowering, while it may be regretted

    def observe(self, preemptions: int, requests: int) -> int:
        """A round ended with these counts; returns the TP size for the next round."""
        rate = preemptions / requests if requests else 0.0
        i = self.allowed.index(self.tp)
        if self.since_lower is not None:
            self.since_lower += 1
        if rate > self.cfg.raise_at:
            self.calm = 0
            if i + 1 < len(self.allowed):
                if self.since_lower is not None and self.since_lower <= self.need_calm:
                    self.need_calm = min(2 * self.need_calm, BACKOFF_CAP * self.cfg.calm_rounds)
                self.tp = self.allowed[i + 1]
                self.since_lower = None
        elif rate <= self.cfg.lower_at:
            self.calm += 1
            if self.calm >= self.need_calm and i > 0:
                self.tp = self.allowed[i - 1]
                self.calm, self.since_lower = 0, 0
        else:
            self.calm = 0
        return self.tp

    def state_dict(self) -> dict:
        return {"tp": self.tp, "calm": self.calm, "need_calm": self.need_calm, "since_lower": self.since_lower}

    def load_state_dict(self, state: dict) -> None:
        if state["tp"] not in self.allowed:
            raise ValueError(f"control.elastic_tp: saved TP size {state['tp']} is not one of {self.allowed}")
        self.tp, self.calm = state["tp"], state["calm"]
        self.need_calm, self.since_lower = state["need_calm"], state["since_lower"]


def round_seconds(cost, engines: int, samples: int, mean_tokens: float, longest: float, prompt_tokens: float,
                  max_seqs: int) -> float:
    """A round's rollout time on `engines` engines of this cost (rlsys.costs.EngineCost): the slower of the
    throughput phase (every engine decoding its share of the tokens at the batch its KV cache holds) and
    the longest sample decoded almost alone at the end. A planner's estimate, not the simulator's clock."""
    per_engine = math.ceil(samples / engines)
    held = prompt_tokens + mean_tokens / 2  # a sample's KV over its life
    batch = max(1, min(per_engine, max_seqs, int(cost.kv_capacity // held)))
    bulk = per_engine * mean_tokens / batch * cost.step_s(batch, batch * held)
    tail = longest * cost.step_s(1, prompt_tokens + longest / 2)
    return max(bulk, tail)


def plan_tp(costs: dict, gpus: int, **round_) -> int:
    """RollPacker's parallelism planner, by our rule: before a round, the TP size (from `costs`, one
    EngineCost per allowed size) whose engines finish the round soonest by `round_seconds`."""
    return min(costs, key=lambda tp: (round_seconds(costs[tp], gpus // tp, **round_), tp))
