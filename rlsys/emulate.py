"""Live runs on a GPU's clock (`emulate:` in the config, docs/design.md "Emulated clock").

Each paced part holds its step until the cost model's seconds for it (rlsys/costs.py, the simulator's own),
times `emulate.time_scale`, have passed since the step began: the built-in engine each prefill and decode step
(`EnginePacer`), each trainer rank each micro-batch (`TrainerPacer`), the controller each weight publish.
Tokens, rewards and gradients stay real; only the clock follows the model. A step whose real compute took
longer than its modelled time is an overrun; a run whose overrun share passes `emulate.overrun_limit` did not
emulate, and says so. A token of the run's model stands for `tokens_per_token` (k) tokens of the emulated one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from rlsys import costs
from rlsys.errors import UserError


@dataclass
class Pacer:
    """Holds paced work until `modelled_s x time_scale` after it began; counts what it held and what overran."""
    time_scale: float
    held: int = 0
    overruns: int = 0

    def hold(self, started: float, modelled_s: float) -> None:
        """`started`: time.perf_counter() when the work began."""
        deadline = started + modelled_s * self.time_scale
        self.held += 1
        if time.perf_counter() > deadline:
            self.overruns += 1
        while (left := deadline - time.perf_counter()) > 0:  # sleep may wake a hair early
            time.sleep(left)

    def counts(self) -> dict[str, int]:
        return {"held": self.held, "overruns": self.overruns}


@dataclass
class EnginePacer(Pacer):
    cost: costs.EngineCost = None
    k: int = 1

    def step_s(self, prefill_tokens: int, running: int, live_kv: int) -> float:
        """A step of the built-in engine: its prefill, then one decode step of `running` sequences over `live_kv`
        cached tokens, which stands for k decode steps of the emulated model (its KV growing by `running` each)."""
        k, cost = self.k, self.cost
        seconds = k * prefill_tokens * cost.prefill_s_per_token
        if running:
            seconds += k * cost.step_s(running, k * live_kv + running * (k - 1) / 2)  # the k steps' mean KV
        return seconds

    def step(self, started: float, prefill_tokens: int, running: int, live_kv: int) -> None:
        self.hold(started, self.step_s(prefill_tokens, running, live_kv))


@dataclass
class TrainerPacer(Pacer):
    model: costs.ModelShape = None
    gpu: costs.GPU = None
    gpus: float = 1.0  # the emulated GPUs of this rank
    k: int = 1

    def micro_batch_s(self, tokens: int, flops_per_param_token: float) -> float:
        return costs.train_gpu_seconds(self.model, self.gpu, self.k * tokens, costs.TRAIN_MFU,
                                       flops_per_param_token) / self.gpus

    def micro_batch(self, started: float, tokens: int, flops_per_param_token: float) -> None:
        self.hold(started, self.micro_batch_s(tokens, flops_per_param_token))


def clock_label(cfg) -> str:
    """What a run's times are (`cfg`: its EmulateConfig): "emulated <gpu>/<model>", or wall time."""
    return f"emulated {cfg.gpu}/{cfg.model}" if cfg.on else "wall"


class Emulation:
    """The run's emulated GPU and model (`cfg`: an EmulateConfig that is on) and its pacers."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.model, self.gpu = costs.MODELS[cfg.model], costs.GPUS[cfg.gpu]
        try:
            self.engine_cost = costs.EngineCost.build(self.model, self.gpu, cfg.tp)
        except ValueError as e:
            raise UserError(f"emulate.tp={cfg.tp}: {e} (emulate.model={cfg.model}, emulate.gpu={cfg.gpu})") from None
        self.sync_s = costs.sync_seconds(self.model)
        self.label = clock_label(cfg)

    def engine_pacer(self) -> EnginePacer:
        return EnginePacer(self.cfg.time_scale, cost=self.engine_cost, k=self.cfg.tokens_per_token)

    def trainer_pacer(self, world_size: int) -> TrainerPacer:
        return TrainerPacer(self.cfg.time_scale, model=self.model, gpu=self.gpu,
                            gpus=self.cfg.trainer_gpus / world_size, k=self.cfg.tokens_per_token)

    def sync_pacer(self) -> Pacer:
        return Pacer(self.cfg.time_scale)

    def describe(self) -> dict:
        """What every report of the run carries beside its times."""
        c = self.cfg
        return {"emulate/label": self.label, "emulate/time_scale": c.time_scale,
                "emulate/tokens_per_token": c.tokens_per_token, "emulate/tp": c.tp,
                "emulate/trainer_gpus": c.trainer_gpus}


class Overruns:
    """The run's overrun share from its pacers' cumulative counts: per step and over the run."""

    def __init__(self, limit: float):
        self.limit = limit
        self.held = self.overruns = 0  # over the run so far

    def step(self, counts: list[dict]) -> dict:
        """`counts`: every pacer's cumulative counts now. The share of this step's held work that overran."""
        held, overruns = sum(c["held"] for c in counts), sum(c["overruns"] for c in counts)
        step_held, step_over = max(0, held - self.held), max(0, overruns - self.overruns)
        self.held, self.overruns = max(held, self.held), max(overruns, self.overruns)
        return {"emulate/overrun_share": step_over / step_held if step_held else 0.0, "emulate/held": step_held}

    def summary(self) -> dict:
        share = self.overruns / self.held if self.held else 0.0
        return {"emulate/overrun_share": share, "emulate/emulating": share <= self.limit}
