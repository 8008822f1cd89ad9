"""Workload configs for `rlsys simulate`: pydantic models, unknown keys refused with the field's name."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError, model_validator

from rlsys.config import ConfigError, ConfigSource, ControlConfig, Section, format_errors, read_yaml_mapping
from rlsys.control.elastic_tp import tp_sizes
from rlsys.placement import lent_engines
from rlsys import costs
from rlsys.costs import GPUS, MODELS, EngineCost, ModelShape


class ElasticTPConfig(Section):
    """Elastic rollout parallelism: the engines' TP size moves between rounds (rlsys/control/elastic_tp.py),
    simulated only. Sizes are the powers of two from min_tp to max_tp."""
    enabled: bool = False
    # round: before each round, the size that finishes it soonest by the cost model, from the round's type
    # (tail's long or short) and lengths (rlsys/control/elastic_tp.py plan_tp), a long round at most at
    # cluster.tp (rlsys/sim/simulator.py _plan_next_round says why); preemptions: the reactive
    # rule below, from the last round's preemptions
    rule: Literal["round", "preemptions"] = "round"
    # round: a long round at most at cluster.tp, the loss RollPacker's TP study measured (in sample to that study:
    # rlsys/sim/calibration.py lifts it held out); false, the cost model's choice alone
    long_rounds_at_base: bool = True
    min_tp: int = Field(1, ge=1)
    max_tp: int = Field(8, ge=1)
    raise_at: float = Field(0.02, ge=0)  # preemptions per request in a round above which TP doubles
    lower_at: float = Field(0.0, ge=0)  # ... at or below which a round counts as calm
    calm_rounds: int = Field(3, ge=1)  # calm rounds in a row before TP halves

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_tp > self.max_tp or self.lower_at > self.raise_at:
            raise ValueError("control.elastic_tp needs min_tp <= max_tp and lower_at <= raise_at")
        return self


class SimControlConfig(ControlConfig):
    """The live `control` section and what only the simulator models: elastic TP, and RollPacker's response-level
    rule for validation."""
    elastic_tp: ElasticTPConfig = ElasticTPConfig()
    # RollPacker's response-level rule under tail, for validation against its rows only: a short round gives each
    # prompt ceil(tail_eta_r R) samples and trains its first R finishers (rlsys/sim/first_r.py). Live tail refuses
    # it: it biases every group toward short answers. None: tail's whole groups.
    tail_eta_r: Optional[float] = Field(None, gt=1)


class ModelSpec(Section):
    """A model by shape, for sizes without a preset."""
    params: float = Field(gt=0)
    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(128, ge=1)
    hidden: int = Field(0, ge=0)  # the residual stream's width, for the trainer's activations; 0: estimated
    intermediate: int = Field(0, ge=0)  # the MLP's width (costs.ModelShape's; the simulator charges no activations)
    vocab: int = Field(0, ge=0)  # the output head's rows (costs.ModelShape's)


class ClusterSpec(Section):
    gpu: Literal[tuple(GPUS)] = "h800"  # a name of rlsys.costs.GPUS
    gpus: int = Field(16, ge=1)
    tp: int = Field(1, ge=1)  # GPUs per rollout engine (the starting size under control.elastic_tp)
    gpus_per_node: int = Field(8, ge=1)  # an engine's GPUs stay within one node
    trainer_gpus: Optional[int] = Field(None, ge=1)  # None: colocated, rollout pauses while training
    # Colocated, how engines and trainer share a GPU, as emulate.colocation (docs/design.md "Emulated clock"): sleep,
    # each switch between them copies the side leaving to host memory and the side arriving back; resident, both
    # stay, and an engine's KV cache is what the trainer's states leave
    colocation: Literal["sleep", "resident"] = "sleep"

    @model_validator(mode="after")
    def _engines_fit(self):
        rollout = self.rollout_gpus
        if rollout < self.tp or rollout % self.tp:
            raise ValueError(f"the {rollout} rollout GPUs must be a positive multiple of tp={self.tp}")
        if self.tp > self.gpus_per_node:
            raise ValueError(f"tp={self.tp} would span nodes of gpus_per_node={self.gpus_per_node}")
        return self

    @property
    def rollout_gpus(self) -> int:
        return self.gpus - (self.trainer_gpus or 0)


class EngineSpec(Section):
    max_seqs: int = Field(256, ge=1)  # vLLM max_num_seqs
    # the slots an engine counts as full in the bubble ratio; unset: a nominal step's requests per engine, at most
    # max_seqs (a replay sets the live run's rollout.slots, since the live ratio counts every slot the engine holds)
    bubble_slots: Optional[int] = Field(None, ge=1)
    dispatch: Literal["request", "prompt"] = "request"  # least-loaded engine per request or per prompt
    memory_fraction: float = Field(costs.MEMORY_FRACTION, gt=0, le=1)  # vLLM gpu_memory_utilization
    kv_watermark: float = Field(0.01, ge=0, lt=1)  # KV share kept free when admitting
    step_overhead_ms: float = Field(costs.STEP_OVERHEAD_S * 1e3, ge=0)  # scheduling and sampling on the CPU, per step
    allreduce_us: float = Field(costs.ALLREDUCE_S * 1e6, ge=0)  # one tensor-parallel all-reduce (two per layer)
    tp_efficiency: float = Field(costs.TP_EFFICIENCY, gt=0, le=1)  # per TP doubling, of the ideal split (costs.py)
    decode_mfu: float = Field(costs.DECODE_MFU, gt=0, le=1)
    prefill_mfu: float = Field(costs.PREFILL_MFU, gt=0, le=1)
    # 0: paged attention (vLLM), a step reads the live KV; above 0: attention padded to the longest sequence's key
    # bucket (the built-in engine), walked in this many us a key a step (costs.BUILTIN_ENGINE["key_s"])
    padded_key_us: float = Field(0.0, ge=0)


class WorkloadSpec(Section):
    """Response lengths: lognormal, with a per-prompt scale (published RL traces: prompt identity explains
    ~65% of length variance) and a share of runaway samples that loop until the cap."""
    max_tokens: int = Field(8192, ge=1)
    median_tokens: float = Field(1500, gt=0)
    sigma: float = Field(0.9, ge=0)  # sd of log length over all samples
    prompt_share: float = Field(0.65, ge=0, le=1)  # share of log-length variance set by the prompt
    runaway_share: float = Field(0.01, ge=0, le=1)
    prompt_tokens: float = Field(300, gt=0)  # median prompt length
    max_prompt_tokens: int = Field(2048, ge=1)
    success_rate: float = Field(0.5, ge=0, le=1)  # mean per-prompt chance that a sample is correct
    dataset_size: int = Field(20000, ge=1)


class RewardKind(Section):
    share: float = Field(gt=0)  # relative share of prompts using this reward
    median_s: float = Field(ge=0)
    sigma: float = Field(0.5, ge=0)
    timeout_s: Optional[float] = Field(None, gt=0)
    workers: Optional[int] = Field(None, ge=1)  # this kind's own pool (ROLL: a reward cluster per kind); None: shared


class RewardSpec(Section):
    kinds: dict[str, RewardKind] = {"rule": RewardKind(share=1.0, median_s=0.005)}
    workers: Optional[int] = Field(None, ge=1)  # the pool of kinds without their own; None: as many as needed
    # True: each sample is scored as it finishes, overlapped with generation (RollPacker's reward scheduler).
    # False: a step's samples are scored after its rollout, before training starts (veRL).
    overlap: bool = True

    @model_validator(mode="after")
    def _some_kind(self):
        if not self.kinds:
            raise ValueError("give at least one reward kind")
        return self


class TrainerSpec(Section):
    mfu: float = Field(costs.TRAIN_MFU, gt=0, le=1)
    # how its Adam states are sharded over its GPUs, as the live trainer.zero_stage (a replay sets the run's);
    # 3, all of them, as veRL's FSDP and Megatron's distributed optimizer over TP shards keep no whole copy
    zero_stage: int = Field(3, ge=0, le=3)
    # Data parallelism over more GPUs loses MFU (Megatron on Qwen3-30B-A3B: 0.40 / 0.37 / 0.31 on 8 / 16 / 32
    # GPUs, docs/performance.md "Calibration sources"), and loses more per doubling the more GPUs there are: each
    # GPU adds `comm_per_gpu` of unhidden communication to a step's compute, so the step takes 1 + comm_per_gpu * GPUs
    # of its compute (0.0134 fits those three points). `mfu` holds on `mfu_gpus` trainer GPUs and scales by that
    # law to other counts. mfu_gpus None: mfu on any count.
    mfu_gpus: Optional[int] = Field(None, ge=1)
    comm_per_gpu: float = Field(0.0, ge=0)
    # forward+backward, and a forward for the old log-probs
    flops_per_param_token: float = Field(costs.TRAIN_FLOPS + costs.FORWARD_FLOPS, gt=0)
    overhead_s: float = Field(2.0, ge=0)
    # Gradients of the groups a scheduler streams (Accumulate) are computed on GPUs idle during the rollout
    # (RollPacker's stream trainer); only the rest is left for after the round.
    streamed: bool = False
    # Colocated, without scale_down_at: each streamed batch takes every GPU and the engines wait for it, as an
    # engine and a trainer micro-batch contend for a modelled GPU live (rlsys/emulate.py GPUTimeline); False: only
    # GPUs with nothing to decode train it.
    contend: bool = False
    # The scale-down of RollPacker's artifact, a fixed gate (not the paper's description of it): once this share
    # of a streamed step's groups is complete, half the engines move their requests (resumed with the tokens
    # they have, prefilled again) to the other half, and the streamed gradients run on the freed GPUs alone until
    # the step ends (its stream-trainer example: infer_scaling_down_progress_ratio 0.4). None: on whatever engines
    # are idle. Colocated only.
    scale_down_at: Optional[float] = Field(None, gt=0, le=1)
    # GPUs of one trainer replica (TP x PP x CP): a streamed trainer borrows idle rollout GPUs in such blocks
    replica_gpus: int = Field(1, ge=1)

    def mfu_on(self, gpus: int) -> float:
        if self.mfu_gpus is None:
            return self.mfu
        return min(1.0, self.mfu * (1 + self.comm_per_gpu * self.mfu_gpus) / (1 + self.comm_per_gpu * gpus))


class WeightSyncSpec(Section):
    bandwidth_gbps: float = Field(costs.LINK_GBPS, gt=0)  # GB/s of full weights
    latency_s: float = Field(costs.SYNC_LATENCY_S, ge=0)


class SchedulerRun(Section):
    """One scheduler to simulate, with optional overrides of `control` and `cluster`."""
    name: str
    label: Optional[str] = None
    control: dict[str, Any] = {}
    cluster: dict[str, Any] = {}
    reward: dict[str, Any] = {}
    trainer: dict[str, Any] = {}


class SimConfig(Section):
    name: str = "sim"
    seed: int = 0
    steps: int = Field(10, ge=1)  # trained steps per scheduler
    schedulers: list[Union[str, SchedulerRun]] = Field(["sync"], min_length=1)
    model: Union[str, ModelSpec] = "qwen2.5-7b"
    cluster: ClusterSpec = ClusterSpec()
    engine: EngineSpec = EngineSpec()
    workload: WorkloadSpec = WorkloadSpec()
    reward: RewardSpec = RewardSpec()
    trainer: TrainerSpec = TrainerSpec()
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    control: SimControlConfig = SimControlConfig(prompts_per_step=128, group_size=8)

    @model_validator(mode="after")
    def _consistent(self):
        if isinstance(self.model, str) and self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is not a preset; choose one of {', '.join(MODELS)} "
                             "or give params, layers, kv_heads")
        for run in self.runs():
            if "kinds" in run.reward:  # the workload draws reward latencies once, for every run alike
                raise ValueError(f"schedulers: {run.label}: reward.kinds is set once for all runs, at the top")
        labels = [r.label for r in self.runs()]
        if len(set(labels)) != len(labels):
            raise ValueError(f"schedulers: labels must be unique, got {labels}; set `label`")
        for i, run in enumerate(self.runs()):
            for section, build in (("control", self.control_for), ("cluster", self.cluster_for),
                                   ("reward", self.reward_for), ("trainer", self.trainer_for)):
                try:
                    build(run)
                except ValidationError as e:
                    where = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(top)'}: {x['msg']}" for x in e.errors())
                    raise ValueError(f"schedulers[{i}].{section}: {where}") from None
        for run in self.runs():
            self._trainer_fits(run)
        need = self.workload.max_prompt_tokens + self.workload.max_tokens
        if min(self.engine_cost(self.cluster_for(r), self.trainer_for(r)).kv_capacity for r in self.runs()) < need:
            raise ValueError(f"engine KV cache holds fewer tokens than one request needs ({need}); "
                             "raise cluster.tp or lower workload.max_tokens")
        for run in self.runs():
            trainer, cluster, elastic = self.trainer_for(run), self.cluster_for(run), self.control_for(run).elastic_tp
            if trainer.streamed and run.name != "tail":
                raise ValueError(f"{run.label}: trainer.streamed needs the tail scheduler, the one that announces "
                                 f"its complete groups to the trainer (Accumulate); under {run.name} it would change "
                                 "nothing")
            if self.control_for(run).tail_eta_r is not None and run.name != "tail":
                raise ValueError(f"{run.label}: control.tail_eta_r is RollPacker's response-level rule for the tail "
                                 f"scheduler; under {run.name} it would change nothing")
            if trainer.scale_down_at is not None and not (trainer.streamed and cluster.trainer_gpus is None):
                raise ValueError(f"{run.label}: trainer.scale_down_at lends rollout engines to a streamed trainer "
                                 "on the same GPUs: set trainer.streamed and leave cluster.trainer_gpus unset")
            if elastic.enabled and cluster.tp not in self.tp_sizes(cluster, elastic):
                raise ValueError(f"{run.label}: cluster.tp={cluster.tp} is not a size control.elastic_tp may use: "
                                 f"{self.tp_sizes(cluster, elastic)}")
        return self

    def _trainer_fits(self, run: SchedulerRun) -> None:
        """A trainer whose states and activations (costs.trainer_bytes) pass its GPUs' memory is refused: on all
        GPUs colocated, on its own separate, and on the engines' it is lent alone under trainer.scale_down_at."""
        cluster, trainer = self.cluster_for(run), self.trainer_for(run)
        gpus = cluster.trainer_gpus or cluster.gpus
        if trainer.scale_down_at is not None:
            gpus = len(lent_engines(cluster.rollout_gpus // cluster.tp)) * cluster.tp
        gpu = GPUS[cluster.gpu]
        if costs.trainer_room(self.shape(), gpu, gpus, trainer.zero_stage) < 0:  # engine.memory_fraction is vLLM's
            need = costs.trainer_bytes(self.shape(), gpus, trainer.zero_stage)
            raise ValueError(f"{run.label}: the trainer needs {need / 1e9:.0f} GB on each of its {gpus} GPUs "
                             f"(trainer.zero_stage={trainer.zero_stage}, cluster.gpus={cluster.gpus}, "
                             f"cluster.trainer_gpus={cluster.trainer_gpus}, trainer.scale_down_at="
                             f"{trainer.scale_down_at}), more than the {costs.MEMORY_FRACTION * gpu.memory / 1e9:.0f} "
                             f"GB usable of a {cluster.gpu}: give it more GPUs or raise trainer.zero_stage")

    def tp_sizes(self, cluster: ClusterSpec, elastic) -> list[int]:
        """The TP sizes elastic TP may pick: within its bounds and a node, dividing the rollout GPUs,
        with room for the weights and one whole request in each engine's KV cache."""
        need = self.workload.max_prompt_tokens + self.workload.max_tokens
        sizes = []
        for tp in tp_sizes(elastic.min_tp, elastic.max_tp):
            if tp > cluster.gpus_per_node or cluster.rollout_gpus % tp:
                continue
            try:
                if self.engine_cost(cluster.model_copy(update={"tp": tp})).kv_capacity >= need:
                    sizes.append(tp)
            except ValueError:  # the weights alone do not fit
                continue
        return sizes

    def runs(self) -> list[SchedulerRun]:
        out = [SchedulerRun(name=r) if isinstance(r, str) else r for r in self.schedulers]
        return [r.model_copy(update={"label": r.label or r.name}) for r in out]

    def shape(self) -> ModelShape:
        return MODELS[self.model] if isinstance(self.model, str) else ModelShape(**self.model.model_dump())

    def cluster_for(self, run: SchedulerRun) -> ClusterSpec:
        return ClusterSpec.model_validate({**self.cluster.model_dump(), **run.cluster})

    def reward_for(self, run: SchedulerRun) -> RewardSpec:
        return RewardSpec.model_validate({**self.reward.model_dump(), **run.reward})

    def trainer_for(self, run: SchedulerRun) -> TrainerSpec:
        return TrainerSpec.model_validate({**self.trainer.model_dump(), **run.trainer})

    def control_for(self, run: SchedulerRun) -> SimControlConfig:
        return SimControlConfig.model_validate({**self.control.model_dump(), **run.control, "scheduler": run.name})

    def engine_cost(self, cluster: ClusterSpec, trainer: Optional[TrainerSpec] = None) -> EngineCost:
        """An engine of `cluster`; colocated resident, beside the states of `trainer` (None: the top-level one)."""
        e, w = self.engine, self.workload
        padded = {"key_s": e.padded_key_us / 1e6, "max_len": w.max_prompt_tokens + w.max_tokens} \
            if e.padded_key_us else {}
        resident = 0.0
        if cluster.trainer_gpus is None and cluster.colocation == "resident":
            resident = costs.trainer_bytes(self.shape(), cluster.gpus, (trainer or self.trainer).zero_stage)
        return EngineCost.build(self.shape(), GPUS[cluster.gpu], cluster.tp, e.memory_fraction,
                                e.step_overhead_ms / 1e3, e.decode_mfu, e.prefill_mfu, e.allreduce_us / 1e6,
                                e.tp_efficiency, **padded, resident=resident)


def load_sim_config(source: Union[str, Path, dict, SimConfig]) -> SimConfig:
    """A SimConfig from a YAML path, a plain dict or an existing SimConfig."""
    if isinstance(source, SimConfig):
        return source
    path, text = Path("<dict>"), ""
    if isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        raw, text = read_yaml_mapping(path, "simulator config")
    try:
        return SimConfig.model_validate(raw)
    except ValidationError as e:
        raise format_errors(e, ConfigSource(path, text or "{}", {})) from None
    except ValueError as e:  # raised while building the engine cost model
        raise ConfigError(f"{path}: {e}") from None
