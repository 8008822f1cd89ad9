"""Live runs on a GPU's clock (`emulate:` in the config, docs/design.md "Emulated clock").

Each paced part holds its step until the cost model's seconds for it (rlsys/costs.py, the simulator's own),
times `emulate.time_scale`, have passed since the step began: the built-in engine each prefill and decode step
(`EnginePacer`), each trainer rank each micro-batch (`TrainerPacer`), the controller each weight publish.
Tokens, rewards and gradients stay real; only the clock follows the model. A step whose real compute took
longer than its modelled time is an overrun; a run whose overrun share passes `emulate.overrun_limit` did not
emulate, and says so. A token of the run's model stands for `tokens_per_token` (k) tokens of the emulated one.

One GPU budget: the run's modelled GPUs (`emulate.gpus`) are laid out by rlsys/placement.py, engines first, the
trainer on all of them (colocated) or on those the engines leave (separate). Where an engine and the trainer share
a modelled GPU they contend for it, as they would for a real one: each paced engine step and each paced trainer
micro-batch reserves its GPUs' timeline (`GPUTimeline`) and begins only when the work before it there has ended,
so an engine never steps while a trainer micro-batch runs on its GPU. (Whole steps rather than a share of the GPU:
a decode step is bound by reading the weights and the KV cache, a micro-batch by the tensor cores, and neither
leaves the other a share worth modelling.) And they switch it, as on a real GPU (`emulate.colocation`): asleep, an
engine's weights and the trainer's states do not fit beside each other and the engine's KV cache, so each
reservation by the other side than the GPU's last one first pays the switch (costs.switch_seconds: the side
leaving copied to host memory, the side arriving back); resident, the trainer's states stay beside the engine,
no switch is paid, and the engine's KV cache is what they leave (`costs.trainer_bytes`). A trainer whose states
pass its GPUs' memory is refused (`check_trainer_fits`).

RollPacker's stream trainer (`trainer.scale_down_at`): from the scale-down to the step's Train, the trainer's
micro-batches reserve only the GPUs of the engines the scale-down freed, and run at those GPUs' count (half the
trainer's: each takes twice as long), so the kept engines decode undisturbed beside them; this is how tail-streamed
trains during the round without a GPU more than tail. After the Train every engine is idle, and the trainer has all
its GPUs again (`TrainerPacer.lend`).
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from rlsys import costs
from rlsys.placement import PlacementError, lent_engines, plan_placement


@dataclass(frozen=True)
class Budget:
    """The run's modelled GPUs and who stands on which: each engine's (its TP GPUs) and the trainer's."""
    gpus: int
    layout: str
    engines: tuple[tuple[int, ...], ...]
    trainer: tuple[int, ...]

    @classmethod
    def of(cls, cfg, engines: int, trainer_world: int = 1, zero_stage: int | None = 2) -> "Budget":
        """`cfg`: an EmulateConfig that is on; `engines`: rollout.num_workers; `zero_stage`: trainer.zero_stage
        (None: no memory checked, for a run on a real GPU, whose model is not cfg.model). Without `emulate.gpus`,
        every engine and the trainer's `emulate.trainer_gpus` have GPUs of their own (separate), and the budget is
        their sum."""
        tp, layout = cfg.tp, cfg.layout
        gpus = cfg.gpus if cfg.gpus is not None else engines * tp + (cfg.trainer_gpus or 8)
        if cfg.gpus is None:
            layout = "separate"
        need = engines * tp + (1 if layout == "separate" else 0)
        if need > gpus:
            plus = " plus at least 1 for the trainer" if layout == "separate" else ""
            raise PlacementError(f"emulate.layout={layout}: rollout.num_workers={engines} x emulate.tp={tp} = "
                                 f"{engines * tp} GPUs{plus} need more than emulate.gpus={gpus}")
        trainer_gpus = gpus if layout == "colocated" else gpus - engines * tp
        if trainer_gpus % trainer_world:
            raise PlacementError(f"trainer.world_size={trainer_world} must divide the trainer's {trainer_gpus} "
                                 f"modelled GPUs (emulate.gpus={gpus}, emulate.layout={layout})")
        if zero_stage is not None:
            check_trainer_fits(cfg, trainer_gpus, zero_stage, f"its {trainer_gpus} modelled GPUs " + (
                f"(emulate.trainer_gpus={trainer_gpus})" if cfg.gpus is None else
                f"(emulate.gpus={gpus}, emulate.layout={layout}, rollout.num_workers={engines}, emulate.tp={tp})"))
            engine_cost(cfg, trainer_gpus if layout == "colocated" else None, zero_stage)  # refused if no KV is left
        plan = plan_placement(1, gpus, engines, tp, trainer_gpus, layout)
        return cls(gpus, layout, tuple(s.gpus for s in plan.engines), tuple(s.gpus[0] for s in plan.trainer))

    @classmethod
    def of_run(cls, run_cfg) -> "Budget":
        """The budget of a run's Config whose emulate section is on."""
        engines, world, zero = run_cfg.rollout.num_workers, run_cfg.trainer.world_size, run_cfg.trainer.zero_stage
        lent = len(lent_engines(engines)) * run_cfg.emulate.tp
        if run_cfg.trainer.scale_down_at is not None:  # first: what it lends may hold no trainer at all
            if lent % world:
                raise PlacementError(f"trainer.scale_down_at lends the trainer the modelled GPUs of the engines it "
                                     f"scales down, {lent} (rollout.num_workers={engines}, emulate.tp="
                                     f"{run_cfg.emulate.tp}): trainer.world_size={world} must divide them")
            # it trains on them alone until the Train
            check_trainer_fits(run_cfg.emulate, lent, zero, f"the {lent} modelled GPUs of the engines "
                               f"trainer.scale_down_at scales down (rollout.num_workers={engines}, emulate.tp="
                               f"{run_cfg.emulate.tp})")
        return cls.of(run_cfg.emulate, engines, world, zero)

    def trainer_rank(self, rank: int, world: int) -> tuple[int, ...]:
        """The modelled GPUs of live trainer rank `rank` of `world`: an equal slice of the trainer's."""
        return equal_slices(self.trainer, world)[rank]

    def gpus_of(self, engines: list[int]) -> tuple[int, ...]:
        return tuple(g for i in engines for g in self.engines[i])

    def lent(self, engines: list[int], world: int) -> list[tuple[int, ...]]:
        """Each of `world` trainer ranks' modelled GPUs while `engines` lend theirs (trainer.scale_down_at): an
        equal slice of those."""
        return equal_slices(self.gpus_of(engines), world)


def engine_cost(cfg, trainer_gpus: int | None, zero_stage: int) -> costs.EngineCost:
    """An engine of `cfg` (an EmulateConfig); resident (`trainer_gpus` given, emulate.colocation=resident), beside
    the trainer's states and activations on each of its GPUs, its KV cache what they leave."""
    model, gpu = costs.MODELS[cfg.model], costs.GPUS[cfg.gpu]
    resident = trainer_gpus is not None and cfg.colocation == "resident"
    try:
        return costs.EngineCost.build(model, gpu, cfg.tp, resident=costs.trainer_bytes(model, trainer_gpus, zero_stage)
                                      if resident else 0.0)
    except ValueError as e:
        fields = f"emulate.colocation=resident, trainer.zero_stage={zero_stage}, " if resident else ""
        raise PlacementError(f"emulate.tp={cfg.tp}: {e} ({fields}emulate.model={cfg.model}, emulate.gpu={cfg.gpu})"
                             ) from None


def check_trainer_fits(cfg, gpus: int, zero_stage: int, where: str) -> None:
    """Refuses a trainer of `cfg.model` (an EmulateConfig) whose states and activations on `gpus` modelled GPUs
    (`where`) pass their memory, as a real one would run out of it."""
    model, gpu = costs.MODELS[cfg.model], costs.GPUS[cfg.gpu]
    if costs.trainer_room(model, gpu, gpus, zero_stage) < 0:
        need = costs.trainer_bytes(model, gpus, zero_stage)
        raise PlacementError(
            f"emulate.model={cfg.model} trained with Adam under trainer.zero_stage={zero_stage} needs "
            f"{need / 1e9:.0f} GB on each of {where}, more than the {costs.MEMORY_FRACTION * gpu.memory / 1e9:.0f} "
            f"GB usable of an emulate.gpu={cfg.gpu}: give the trainer more modelled GPUs, raise trainer.zero_stage, or "
            "emulate a smaller emulate.model")


def equal_slices(gpus: tuple[int, ...], world: int) -> list[tuple[int, ...]]:
    """`gpus` split among `world` trainer ranks, an equal slice each, in order."""
    share = len(gpus) // world
    return [gpus[rank * share:(rank + 1) * share] for rank in range(world)]


ENGINE, TRAINER = 1.0, 2.0  # who holds a modelled GPU (GPUTimeline); 0.0: nobody yet


class GPUTimeline:
    """Until when each modelled GPU is taken, who took it last (ENGINE, TRAINER) and the seconds that side takes
    to leave it (its bytes to host memory), in one file every process of the run (engines, trainer ranks) shares
    under an exclusive lock: 24 bytes a GPU, three floats. Times are time.perf_counter()'s, which on Linux is
    CLOCK_MONOTONIC: one clock for every process of the machine. Each process opens the file once and overwrites
    its slots in place: a reservation is on the path of every paced step, and reopening, truncating and closing the
    file each time cost ~0.4 ms (ext4 flushes a file truncated then closed)."""
    SLOT = struct.Struct("ddd")

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()  # flock keeps other processes out; this, the other threads of this one

    def __getstate__(self) -> dict:  # a pacer sent to another process (a Ray actor) opens the file there
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"GPUTimeline({self.path!r})"

    @contextmanager
    def _locked(self):
        """The file, opened once, under this process's lock and every process's flock."""
        with self._lock:
            if self._fd is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._fd
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slots(self, fd: int, gpus: tuple[int, ...]) -> list[tuple[float, float, float]]:
        """(until, holder, leave_s) of each GPU: a slot never written (past the end, or a hole) reads as free and
        held by nobody, (0.0, 0.0, 0.0)."""
        size = self.SLOT.size
        return [self.SLOT.unpack(e) if len(e := os.pread(fd, size, g * size)) == size else (0.0, 0.0, 0.0)
                for g in gpus]

    def reserve(self, gpus: tuple[int, ...], began: float, seconds: float) -> float:
        """Take `gpus` for `seconds` from `began` or, if later, from when the work reserved before on any of them
        ends. Returns when this work's time there begins."""
        return self.take(gpus, began, seconds)[0]

    def take(self, gpus: tuple[int, ...], began: float, seconds: float, holder: float = 0.0,
             resident_s: float = 0.0) -> tuple[float, float]:
        """`reserve` by `holder`, whose bytes take `resident_s` to copy each way between a GPU and host memory: on a
        GPU the other side held last, the work begins after the switch (that side's leave_s, then resident_s; on
        all its GPUs at once, so the longest). A GPU nobody has held costs no switch (the run starts loaded).
        Returns when the work begins and the switch it paid."""
        with self._locked() as fd:
            slots = self._slots(fd, gpus)
            switch = max([0.0] + [leave + resident_s for _, last, leave in slots if last and holder and last != holder])
            start = max([began, *(until for until, _, _ in slots)]) + switch
            for g in gpus:
                os.pwrite(fd, self.SLOT.pack(start + seconds, holder, resident_s), g * self.SLOT.size)
        return start, switch

    def shorten(self, gpus: tuple[int, ...], until: float, to: float) -> None:
        """Work that reserved `gpus` until `until` ended at `to` instead: each of them nothing has reserved since
        is free from `to` (a later reservation was timed from `until` already and keeps its place)."""
        with self._locked() as fd:
            for g, (end, holder, leave) in zip(gpus, self._slots(fd, gpus)):
                if end == until:
                    os.pwrite(fd, self.SLOT.pack(to, holder, leave), g * self.SLOT.size)


def sleep_until(t: float) -> None:
    """Until time.perf_counter() reaches t (sleep may wake a hair early)."""
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


class Interrupt:
    """Wakes a paced hold from another thread. A real engine takes an abort between two decode steps, but a paced
    step of the run's model stands for k of them: so the hold, woken, waits one emulated decode step and calls
    `land` on its own thread (the engine applies the queued aborts there); `land` says whether anything is left
    to hold for. Nothing left (a round's end, a scale-down) ends the work there and frees its GPUs."""

    def __init__(self, land: Callable[[], bool]):
        self.land = land
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()  # a wake between two holds wakes the next one, which finds nothing to land: harmless

    def wait(self, seconds: float) -> bool:
        woken = self._event.wait(seconds)
        self._event.clear()
        return woken


@dataclass
class Pacer:
    """Holds paced work until `modelled_s x time_scale` after it began; counts what it held and what overran."""
    time_scale: float
    held: int = 0
    overruns: int = 0
    overrun_s: float = 0.0  # the run's seconds (wall over time_scale) by which real compute passed modelled time
    timeline: GPUTimeline | None = None  # where the work contends for its modelled GPUs (colocated)
    on_gpus: tuple[int, ...] = ()  # the modelled GPUs the work runs on
    holder: float = 0.0  # ENGINE or TRAINER: who the work is, on a GPU the other side shares
    resident_s: float = 0.0  # seconds to copy this side's bytes on a GPU to or from host memory (asleep; 0 resident)
    switch_s: float = 0.0  # switches paid before this part's work, in all

    def hold(self, started: float, modelled_s: float, interrupt: Interrupt | None = None,
             grain: int = 1) -> tuple[float, float]:
        """`started`: time.perf_counter() when the work began. Waiting for a GPU another part holds is not an
        overrun; real compute longer than the modelled time is. Returns the work's modelled (begin, end). The work
        is `grain` steps: an `interrupt` lands after the one it woke in, and may end the work there."""
        seconds = modelled_s * self.time_scale
        now = time.perf_counter()
        self.held += 1
        if now > started + seconds:
            self.overruns += 1
            self.overrun_s += (now - started - seconds) / self.time_scale
        begin = started
        if self.timeline:
            begin, switch = self.timeline.take(self.on_gpus, started, seconds, self.holder,
                                               self.resident_s * self.time_scale)
            self.switch_s += switch / self.time_scale
        deadline = begin + seconds
        while (left := deadline - time.perf_counter()) > 0:  # sleep may wake a hair early
            if interrupt is None:
                time.sleep(left)
            elif interrupt.wait(left):
                at = min(deadline, max(time.perf_counter(), begin) + seconds / grain)
                sleep_until(at)
                if not interrupt.land():
                    if self.timeline:
                        self.timeline.shorten(self.on_gpus, deadline, at)
                    deadline = at
        return begin, deadline

    def counts(self) -> dict[str, float]:
        return {"held": self.held, "overruns": self.overruns, "overrun_s": self.overrun_s, "switch_s": self.switch_s}


@dataclass
class EnginePacer(Pacer):
    cost: costs.EngineCost = None
    k: int = 1
    prompt_tokens: int | None = None  # emulate.prompt_tokens: what each prompt stands for; None: k per token

    def emulated(self, tokens: float, prompts: int, prompt_tokens: float) -> float:
        """Emulated tokens of `tokens` run tokens, `prompt_tokens` of them the prompts' of `prompts` sequences."""
        return emulated_tokens(self.k, self.prompt_tokens, tokens, prompts, prompt_tokens)

    def step_s(self, prefill_tokens: int, running: int, live_kv: int, prompts: int = 0, prompt_prefill: int = 0,
               prompt_kv: int = 0) -> float:
        """A step of the built-in engine: its prefill (`prompts` prompts of `prompt_prefill` tokens among
        `prefill_tokens`), then one decode step of `running` sequences over `live_kv` cached tokens (`prompt_kv`
        of them their prompts'), which stands for k decode steps of the emulated model (its KV growing by
        `running` each)."""
        k, cost = self.k, self.cost
        seconds = self.emulated(prefill_tokens, prompts, prompt_prefill) * cost.prefill_s_per_token
        if running:
            kv = self.emulated(live_kv, running, prompt_kv)
            seconds += k * cost.step_s(running, kv + running * (k - 1) / 2)  # the k steps' mean KV
        return seconds

    def step(self, started: float, prefill_tokens: int, running: int, live_kv: int,
             interrupt: Interrupt | None = None, **prompt) -> tuple[float, float]:
        return self.hold(started, self.step_s(prefill_tokens, running, live_kv, **prompt), interrupt, grain=self.k)


def emulated_tokens(k: int, per_prompt: int | None, tokens: float, prompts: int, prompt_tokens: float) -> float:
    """k emulated tokens per run token, but a prompt's `per_prompt` where that is set (emulate.prompt_tokens):
    long-CoT RL's prompts are a few hundred tokens whatever the response cap, so k must not scale them."""
    if per_prompt is None:
        return k * tokens
    return k * (tokens - prompt_tokens) + per_prompt * prompts


@dataclass
class TrainerPacer(Pacer):
    model: costs.ModelShape = None
    gpu: costs.GPU = None
    gpus: float = 1.0  # the emulated GPUs of this rank
    k: int = 1
    prompt_tokens: int | None = None  # as EnginePacer's
    own: tuple = ()  # (on_gpus, gpus) of the rank's own GPUs while it trains on lent ones
    lent_held: int = 0  # micro-batches held on lent GPUs
    sleeps: bool = False  # its GPUs shared asleep (emulate.colocation): its states leave them at each switch
    zero_stage: int = 2  # trainer.zero_stage, by which its states are sharded over the trainer's GPUs
    world: int = 1  # live trainer ranks, each on an equal slice of the trainer's GPUs

    def __post_init__(self):
        self._shard()

    def _shard(self) -> None:
        """Its states on each of its GPUs (the whole trainer's sharded over all ranks' GPUs), as host-copy seconds."""
        if self.sleeps:
            states = costs.trainer_states(self.model, len(self.on_gpus) * self.world, self.zero_stage)
            self.resident_s = costs.switch_seconds(self.gpu, states, 0.0)

    def lend(self, gpus: tuple[int, ...] | None) -> None:
        """Train on these modelled GPUs from the next micro-batch on, at their count (trainer.scale_down_at: the
        GPUs of the engines scaled down; the trainer's states sharded over them); None: on the rank's own again."""
        self.own = self.own or (self.on_gpus, self.gpus)
        self.on_gpus, self.gpus = (gpus, len(gpus)) if gpus else self.own
        self._shard()

    def counts(self) -> dict[str, float]:
        return {**super().counts(), "lent_held": self.lent_held}

    def micro_batch_s(self, tokens: int, flops_per_param_token: float, prompts: int = 0,
                      prompt_tokens: int = 0) -> float:
        """`tokens` of `prompts` sequences, `prompt_tokens` of them their prompts'."""
        emulated = emulated_tokens(self.k, self.prompt_tokens, tokens, prompts, prompt_tokens)
        return costs.train_gpu_seconds(self.model, self.gpu, emulated, costs.TRAIN_MFU,
                                       flops_per_param_token) / self.gpus

    def micro_batch(self, started: float, tokens: int, flops_per_param_token: float, **prompt) -> tuple[float, float]:
        self.lent_held += bool(self.own) and self.on_gpus != self.own[0]
        return self.hold(started, self.micro_batch_s(tokens, flops_per_param_token, **prompt))


def clock_label(cfg) -> str:
    """What a run's times are (`cfg`: its EmulateConfig): "emulated <gpu>/<model>", or wall time."""
    return f"emulated {cfg.gpu}/{cfg.model}" if cfg.on else "wall"


class Emulation:
    """The run's emulated GPU and model (`cfg`: an EmulateConfig that is on), its GPU budget over `engines`
    engines and `trainer_world` live trainer ranks, and its pacers; `run_dir` holds the GPUs' shared timeline."""

    def __init__(self, cfg, engines: int = 1, trainer_world: int = 1, run_dir: str = ".", zero_stage: int = 2):
        self.cfg, self.zero_stage = cfg, zero_stage
        self.budget = Budget.of(cfg, engines, trainer_world, zero_stage)
        colocated = self.budget.layout == "colocated"
        self.timeline = (GPUTimeline(os.path.join(os.path.abspath(run_dir), "emulated_gpus.bin"))
                         if colocated else None)  # separate: no GPU is shared
        self.colocation = cfg.colocation if colocated else None
        self.model, self.gpu = costs.MODELS[cfg.model], costs.GPUS[cfg.gpu]
        self.engine_cost = engine_cost(cfg, len(self.budget.trainer) if colocated else None, zero_stage)
        self.sync_s = costs.sync_seconds(self.model)
        self.label = clock_label(cfg)

    @classmethod
    def of(cls, run_cfg) -> "Emulation":
        """The emulation of a run's Config."""
        return cls(run_cfg.emulate, run_cfg.rollout.num_workers, run_cfg.trainer.world_size, run_cfg.output_dir,
                   run_cfg.trainer.zero_stage)

    @property
    def sleeps(self) -> bool:
        """Engines and trainer share GPUs and switch them (emulate.colocation=sleep)."""
        return self.colocation == "sleep"

    def engine_pacer(self, index: int = 0) -> EnginePacer:
        weights = costs.engine_bytes(self.model, self.cfg.tp)
        return EnginePacer(self.cfg.time_scale, cost=self.engine_cost, k=self.cfg.tokens_per_token,
                           prompt_tokens=self.cfg.prompt_tokens, timeline=self.timeline,
                           on_gpus=self.budget.engines[index], holder=ENGINE,
                           resident_s=costs.switch_seconds(self.gpu, weights, 0.0) if self.sleeps else 0.0)

    def trainer_pacer(self, world_size: int, rank: int = 0) -> TrainerPacer:
        on = self.budget.trainer_rank(rank, world_size)
        return TrainerPacer(self.cfg.time_scale, model=self.model, gpu=self.gpu, gpus=len(on),
                            k=self.cfg.tokens_per_token, prompt_tokens=self.cfg.prompt_tokens, timeline=self.timeline,
                            on_gpus=on, holder=TRAINER, sleeps=self.sleeps, zero_stage=self.zero_stage,
                            world=world_size)

    def switch_seconds(self) -> float:
        """A switch of a shared GPU between an engine and the trainer on all its GPUs, either way (0: none)."""
        if not self.sleeps:
            return 0.0
        states = costs.trainer_states(self.model, len(self.budget.trainer), self.zero_stage)
        return costs.switch_seconds(self.gpu, costs.engine_bytes(self.model, self.cfg.tp), states)

    def sync_pacer(self) -> Pacer:
        return Pacer(self.cfg.time_scale)

    def kv_slots(self, max_prompt_tokens: int, max_new_tokens: int) -> int:
        """Sequences of the longest prompt and response (run tokens) that an engine's modelled KV cache holds at
        once, as vLLM's memory allows: the slots an engine of the emulated GPU would run."""
        k = self.cfg.tokens_per_token
        longest = emulated_tokens(k, self.cfg.prompt_tokens, max_prompt_tokens + max_new_tokens, 1, max_prompt_tokens)
        return int(self.engine_cost.kv_capacity // longest)

    def layout_report(self, run_cfg) -> str:
        """Which engines and trainer GPUs stand on which modelled GPU, and the slots their KV would hold."""
        b = self.budget
        engines = "; ".join(f"engine {i} on GPU {','.join(map(str, g))}" for i, g in enumerate(b.engines))
        slots = self.kv_slots(run_cfg.data.max_prompt_tokens, run_cfg.rollout.max_new_tokens)
        shared = (f"; emulate.colocation={self.colocation}: a switch between an engine and the trainer "
                  f"{self.switch_seconds():.2f} s" if self.colocation else "")
        return (f"emulated: {b.gpus} modelled {self.cfg.gpu} GPUs, {b.layout}: {engines}; trainer on GPUs "
                f"{','.join(map(str, b.trainer))}{shared}; an engine's KV holds {slots} sequences of the longest "
                f"prompt and response (rollout.slots={run_cfg.rollout.slots})")

    def describe(self) -> dict:
        """What every report of the run carries beside its times."""
        c = self.cfg
        return {"emulate/label": self.label, "emulate/time_scale": c.time_scale,
                "emulate/tokens_per_token": c.tokens_per_token, "emulate/prompt_tokens": c.prompt_tokens,
                "emulate/tp": c.tp,
                "emulate/gpus": self.budget.gpus, "emulate/layout": self.budget.layout,
                "emulate/colocation": self.colocation, "emulate/switch_s": self.switch_seconds(),
                "emulate/trainer_gpus": len(self.budget.trainer)}


class Overruns:
    """The run's overrun share from its pacers' cumulative counts: per step and over the run."""

    def __init__(self, limit: float):
        self.limit = limit
        self.held = self.overruns = 0  # over the run so far
        self.overrun_s = 0.0

    def step(self, counts: list[dict]) -> dict:
        """`counts`: every pacer's cumulative counts now. The share of this step's held work that overran, and
        by how many of the run's seconds in all (summed over the parts, which run in parallel)."""
        held, overruns = sum(c["held"] for c in counts), sum(c["overruns"] for c in counts)
        overrun_s = sum(c.get("overrun_s", 0.0) for c in counts)
        step_held, step_over = max(0, held - self.held), max(0, overruns - self.overruns)
        step_s = max(0.0, overrun_s - self.overrun_s)
        self.held, self.overruns = max(held, self.held), max(overruns, self.overruns)
        self.overrun_s = max(overrun_s, self.overrun_s)
        return {"emulate/overrun_share": step_over / step_held if step_held else 0.0, "emulate/held": step_held,
                "emulate/overrun_s": step_s}

    def summary(self) -> dict:
        share = self.overruns / self.held if self.held else 0.0
        return {"emulate/overrun_share": share, "emulate/emulating": share <= self.limit,
                "emulate/overrun_s": self.overrun_s}
