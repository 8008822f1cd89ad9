"""Every option of rlsys, in one place: pydantic models loaded from YAML plus `a.b=value` overrides.

Unknown keys and wrong types are refused with the field's dotted name and the file they came from. This module
is the schema alone and imports nothing of rlsys (docs/design.md "Where the parts meet"): what needs the rest
of rlsys to check (registered names, the user's code, the GPU placement) is checked by rlsys/startup.py.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # the repository's; not installed
# Package data, so `rlsys train` finds it from any install; configs/tiny.yaml is a link to it.
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def read_chat_template(value: str) -> str:
    """model.chat_template's Jinja text: the value itself when it holds a Jinja tag, else the file it names; a
    ValueError saying what is wrong when the file is missing or the template does not parse."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if "{{" in value or "{%" in value:
        text, where = value, "the template"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a Jinja template (no {{{{ or {{% in it) nor a file; give the "
                             "template's text or the path of a file holding it")
        text, where = path.read_text(), str(path)
    try:  # as transformers compiles a chat template
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where} is not a Jinja template: line {e.lineno}: {e.message}") from None
    return text


class WarmStartConfig(Section):
    """Short supervised fine-tuning so RL starts, as in practice, from a partly right policy."""
    steps: int = Field(400, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    seed: int = 0
    # Share of warm-start answers replaced by `noise`, drawn afresh each time an example is seen:
    # the policy learns the right answer as its mode but samples the noise, as a model fine-tuned on imperfect
    # data does, and RL has that spread to remove.
    label_noise: float = Field(0.0, ge=0, le=1)
    # What replaces an answer: near_miss, one character changed, dropped or doubled; or guess, as many random
    # characters (digits for digits): it carries nothing of the answer, so a model that cannot compute it
    # learns no half-computation that would outvote copying a tool's answer (tool_arith, where every direct
    # answer is a guess: label_noise 1; measured in docs/performance.md "Tools").
    noise: Literal["near_miss", "guess"] = "near_miss"
    # Share of examples that demonstrate a tool call instead (a task with demonstrations: tool_arith), drawn
    # afresh each time: the policy starts out calling the tool sometimes and guessing otherwise.
    tool_share: float = Field(0.0, ge=0, le=1)
    # The user's demonstrations for tool_share, module:function or file.py:function: fn(prompt) -> [(text, whether
    # the model wrote it), ...], as tool_tasks.py's (a user environment's task has none built in: without them
    # the warm-started model never calls it)
    demonstrations: Optional[str] = None
    # Where the warm start (and its greedy eval) runs, in the process that builds the model: cuda for a model
    # of hundreds of millions of parameters (configs/gpu/bench_0.5b.yaml), hours on one CPU thread.
    device: Literal["cpu", "cuda"] = "cpu"


class ModelConfig(Section):
    path: Optional[str] = None  # a local Hugging Face directory; None builds the tiny model below
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(384, ge=8)
    max_position_embeddings: int = Field(512, ge=16)
    warm_start: WarmStartConfig = WarmStartConfig()
    cache_dir: str = "~/.cache/rlsys/models"  # built models are cached by what decides their weights, not RL settings
    # A chat template for a model that has none (Jinja, as tokenizer_config.json's chat_template): its text or the
    # path of a file holding it. The run reads the model from links to its files beside the template's file
    # (rlsys/models/__init__.py with_chat_template); a model with a template of its own is refused
    chat_template: Optional[str] = None

    @field_validator("chat_template")
    @classmethod
    def _template_reads(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            read_chat_template(value)
        return value

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.hidden_size must divide by model.num_heads, and num_heads by num_kv_heads")
        return self


class DataConfig(Section):
    # a built-in task family name, the user's family as module:function or file.py:function (rlsys/plugins.py),
    # or "files" to read train_path/eval_path
    task: str = "synthetic"
    train_path: Optional[str] = None  # jsonl or parquet, veRL-style columns
    eval_path: Optional[str] = None
    loader: Optional[str] = None  # task=files: the user's module:function reading train_path/eval_path into rows
    train_size: int = Field(4000, ge=1)  # synthetic tasks only
    eval_size: int = Field(200, ge=1)
    seed: int = 0
    max_prompt_tokens: int = Field(64, ge=1)  # longer prompts are dropped and counted
    chat_template: bool = False  # prompts become a user message rendered with the tokenizer's chat template

    @model_validator(mode="after")
    def _loader_reads_files(self):
        if self.loader and self.task != "files":
            raise ValueError(f"data.loader reads data.train_path, so it needs data.task=files (got {self.task!r})")
        return self


class RolloutConfig(Section):
    engine: str = "cpu"  # cpu, vllm, or an engine added with rlsys.rollout.registry.register_engine
    num_workers: int = Field(1, ge=1)
    slots: int = Field(32, ge=1)  # concurrent sequences per engine (continuous batching capacity)
    max_new_tokens: int = Field(96, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    eval_temperature: Optional[float] = Field(None, ge=0)  # None: the rollout temperature
    eval_samples: int = Field(4, ge=1)  # samples per eval prompt (eval/accuracy is their mean, avg@k)
    eval_greedy: bool = True  # also eval/greedy_accuracy, one greedy sample per prompt
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs per engine (vllm); kept within one node
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)  # vllm: share of each GPU for weights + KV cache
    # Engines give their GPU memory back while the trainer trains (rlsys/train.py). None: on where they share GPUs
    # with it (cluster.layout=colocated, cluster.gpus_per_node >= 1), off elsewhere.
    enable_sleep_mode: Optional[bool] = None
    # The built-in engine's device (rollout.engine=cpu; vllm always runs on GPUs). cuda needs
    # cluster.gpus_per_node >= 1: each rollout worker takes a GPU bundle of the placement plan.
    device: Literal["cpu", "cuda"] = "cpu"
    # Weights and activations of either engine. auto: float32 for the built-in engine on the CPU, else bfloat16.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_restarts: int = Field(3, ge=0)  # a dead worker is replaced up to this many times in a row (none finished)
    # A worker holds finished completions up to this long while its engine runs others: fewer, larger hand-overs
    # leave its decoding the CPU that each call costs (docs/performance.md). 0: each as soon as it is ready.
    handoff_s: float = Field(0.05, ge=0)
    # Staged lengthening, as DeepScaleR's 8k -> 16k -> 24k: [[step, cap], ...], once `step` steps are trained, answers
    # are capped at `cap` tokens (at most max_new_tokens, which sizes the engines and caps eval's).
    max_new_tokens_stages: Optional[list[tuple[int, int]]] = None

    @model_validator(mode="after")
    def _stages_ascend_within_the_cap(self):
        stages = self.max_new_tokens_stages or []
        steps = [s for s, _ in stages]
        if steps != sorted(set(steps)) or (steps and steps[0] < 0):
            raise ValueError(f"rollout.max_new_tokens_stages: steps must be distinct, >= 0 and ascending (got {steps})")
        for step, cap in stages:
            if not 1 <= cap <= self.max_new_tokens:
                raise ValueError(f"rollout.max_new_tokens_stages: the cap from step {step} ({cap}) must be between 1 "
                                 f"and rollout.max_new_tokens ({self.max_new_tokens})")
        return self

    def max_new_tokens_at(self, step: int) -> int:
        """Training's cap on answers at `step`: the last stage begun, max_new_tokens before the first."""
        begun = [cap for s, cap in self.max_new_tokens_stages or [] if s <= step]
        return begun[-1] if begun else self.max_new_tokens

    @property
    def engine_dtype(self) -> str:
        """`dtype` with auto resolved."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.engine == "cpu" and self.device == "cpu" else "bfloat16"

    @property
    def on_gpu(self) -> bool:
        """The engines run on GPUs: vLLM always, the built-in engine with device=cuda."""
        return self.engine == "vllm" or self.device == "cuda"


class OverlongConfig(Section):
    """DAPO overlong shaping: penalty grows linearly over the last `cache_len` tokens before `max_len`."""
    enabled: bool = False
    max_len: int = Field(96, ge=1)
    cache_len: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _cache_within_max(self):
        if self.cache_len > self.max_len:  # the penalty would start before token 0
            raise ValueError(f"reward.overlong.cache_len ({self.cache_len}) must be at most reward.overlong.max_len "
                             f"({self.max_len})")
        return self


class SandboxConfig(Section):
    """Limits of code_tests' sandbox; rlsys/reward/sandbox.py says what each one stops and what it does not."""
    cpu_s: int = Field(3, ge=1)  # CPU seconds per process
    memory_mb: int = Field(512, ge=64)  # address space per process
    file_size_mb: int = Field(16, ge=1)  # largest file written; each private tmpfs holds 4 of them
    max_processes: int = Field(16, ge=1)  # processes and threads of the sandbox's user
    t_min_s: float = Field(1.0, gt=0)  # wall-clock timeout: min(max(t_min_s, 1.5 x slowest pass), t_max_s)
    t_max_s: float = Field(3.0, gt=0)
    uid: int = Field(65534, ge=1)  # the user (and group) the code runs as when rlsys runs as root
    hide_paths: list[str] = []  # hidden besides the temp dirs, the home and the working directory
    allow_unsandboxed: bool = False  # without namespaces, run with resource limits only (else refuse)

    @model_validator(mode="after")
    def _timeouts_ordered(self):
        if self.t_min_s > self.t_max_s:
            raise ValueError(f"t_min_s ({self.t_min_s}) must be at most t_max_s ({self.t_max_s})")
        return self


REWARD_MODEL = "reward_model"  # the name that puts reward.model's score among reward.fn's parts


class RewardModelConfig(Section):
    """A learned reward model, as veRL's reward_model: a Hugging Face sequence-classification model (one label)
    scored in the reward actors; reward.fn names it `reward_model`, alone or as one weighted part."""
    path: Optional[str] = None  # a local Hugging Face folder: config, safetensors weights, tokenizer
    batch_size: int = Field(8, ge=1)  # texts per forward: the items queued when a reward worker is free, up to this
    # cuda: each reward worker takes a GPU the placement plan leaves free (on its own, not beside an engine)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto: float32 on the CPU, else bfloat16


class RewardConfig(Section):
    # A registered name, or the user's module:function or file.py:function; a list of them scores each and sums
    # them with `weights` (TRL's reward_funcs), each part logged as reward/<name>/mean
    fn: Union[str, list[str]] = "exact_match"
    weights: list[float] = []  # one per reward.fn name (TRL's reward_weights); empty: 1.0 each
    model: RewardModelConfig = RewardModelConfig()
    num_workers: int = Field(1, ge=1)
    timeout_s: float = Field(5.0, gt=0)
    fallback: float = 0.0  # reward given to a sample whose reward function raised, hung or returned junk
    valid_range: tuple[float, float] = (-1.0, 1.0)  # a function's value outside it is junk (before overlong)
    overlong: OverlongConfig = OverlongConfig()
    sandbox: SandboxConfig = SandboxConfig()  # code_tests only

    @model_validator(mode="after")
    def _fallback_in_range(self):
        low, high = self.valid_range
        if not low <= self.fallback <= high:
            raise ValueError(f"reward.fallback={self.fallback} must lie within reward.valid_range [{low}, {high}]")
        return self

    @property
    def names(self) -> list[str]:
        """The parts reward.fn names, in order (one for a single name)."""
        return [self.fn] if isinstance(self.fn, str) else list(self.fn)

    @field_validator("weights")
    @classmethod
    def _one_weight_per_part(cls, weights: list[float], info) -> list[float]:
        fn = info.data.get("fn")  # absent when reward.fn itself was refused
        names = [fn] if isinstance(fn, str) else fn
        if weights and names is not None and len(weights) != len(names):
            raise ValueError(f"{len(weights)} weight(s) for the {len(names)} part(s) of reward.fn "
                             f"({', '.join(names)}): give one each, or none for 1.0 each")
        return weights

    @model_validator(mode="after")
    def _parts_weighed(self):
        names = self.names
        if not names:
            raise ValueError("reward.fn is an empty list: name at least one reward function")
        keys = [name.rpartition(":")[2] for name in names]  # each part's metric, reward/<key>/mean
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"reward.fn names {', '.join(repeated)} twice: each part is logged by its function's "
                             "name")
        if REWARD_MODEL in names and not self.model.path:
            raise ValueError(f"reward.fn names {REWARD_MODEL}: set reward.model.path to its Hugging Face folder")
        if self.model.path and REWARD_MODEL not in names:
            raise ValueError(f"reward.model.path is set but reward.fn does not name {REWARD_MODEL}: add it to "
                             "reward.fn (with a weight in reward.weights) or remove reward.model.path")
        return self


class ToolsConfig(Section):
    """Tools the model may call in a rollout (rlsys/tools/): a conversation of several turns per sample."""
    # Built-in names (calculator, python) or the user's module:function or file.py:function; empty: single-turn
    fns: list[str] = []
    max_turns: int = Field(4, ge=1)  # model turns with tool calls per conversation; the next gets no answer
    # calls one model turn may make, run at once; over 1, a turn ends at the model's end-of-turn token
    max_calls_per_turn: int = Field(1, ge=1)
    timeout_s: float = Field(5.0, gt=0)  # per call: past it the call is abandoned and fails
    max_response_chars: int = Field(2000, ge=16)  # longer answers are cut, with a marker saying how much went
    on_failure: Literal["keep", "drop"] = "keep"  # a failed call: its error is the answer | the sample is dropped
    max_workers: int = Field(4, ge=1)  # calls running at once per rollout worker
    memory_mb: int = Field(1024, ge=64)  # address space of each conversation's process of the user's tools
    # The user's environment, module:Class or file.py:Class (rlsys/tools/box.py): one per conversation, reset with
    # its sample (prompt and reference answer), stepped with each call the model makes (with fns: the tools answer
    # the calls), and with a respond(messages), answering each turn that ends without a call as the user; its
    # per-turn rewards add to the sample's reward
    env: Optional[str] = None
    # How per-turn rewards fold into the return every advantage estimator reads (rlsys.types.trajectory_return):
    # sum, R + sum_t r_t | discounted, sum_t gamma^t r_t + gamma^T R (t = 0 the first tool turn, T tool turns)
    return_rule: Literal["sum", "discounted"] = "sum"
    gamma: float = Field(1.0, gt=0, le=1)  # the discount of return_rule=discounted
    sandbox: SandboxConfig = SandboxConfig()  # the python tool's limits (its wall clock is timeout_s)

    @field_validator("fns")
    @classmethod
    def _distinct(cls, fns: list[str]) -> list[str]:
        repeated = sorted({f for f in fns if fns.count(f) > 1})
        if repeated:
            raise ValueError(f"names a tool twice: {', '.join(repeated)}")
        return fns


class KLConfig(Section):
    # k1, k2, k3 (Schulman's), abs (|k1|), k1+ and k3+ (their value with k2's gradient; veRL's straight-through)
    estimator: Optional[Literal["k1", "k2", "k3", "abs", "k1+", "k3+"]] = None
    coef: float = Field(0.0, ge=0)
    bias_correction: bool = False  # the KL term times pi / pi_old (TRL's use_bias_correction_kl)
    # In the reward instead of the loss (veRL's use_kl_in_reward): each sample's reward loses coef x its KL
    # summed over its tokens before the group's advantages; coef is adapted towards `target` when set.
    in_reward: bool = False
    # in_reward at token: each token's KL off that token's reward (veRL's, the standard PPO form), so under gae and
    # reinforce_pp a token's return holds the KL from it on; sequence: the sum off the final reward. Every other
    # advantage reads one reward per sequence: the sum, either way
    reward_level: Literal["sequence", "token"] = "sequence"
    target: Optional[float] = Field(None, gt=0)  # per-token KL the adaptive controller steers to (veRL: target_kl)
    horizon: int = Field(10000, ge=1)  # sequences over which the controller moves coef by up to 20%
    # Refresh the reference every this many optimizer steps (TRL's sync_ref_model, ref_model_sync_steps):
    # ref <- alpha x policy + (1 - alpha) x ref, alpha = ref_mixup_alpha; None: the reference stays the initial policy.
    ref_sync_steps: Optional[int] = Field(None, ge=1)
    ref_mixup_alpha: float = Field(0.6, gt=0, le=1)  # TRL's default

    @property
    def enabled(self) -> bool:
        """A KL term is on, in the loss or the reward (and the trainer keeps a frozen reference model for it)."""
        return bool(self.estimator) and self.coef > 0

    @property
    def in_loss(self) -> bool:
        return self.enabled and not self.in_reward

    @model_validator(mode="after")
    def _reward_options(self):
        if (self.in_reward or self.target is not None) and not self.enabled:
            raise ValueError("trainer.kl.in_reward and trainer.kl.target need trainer.kl.estimator and "
                             "trainer.kl.coef > 0 (the initial coefficient)")
        if self.reward_level == "token" and not self.in_reward:
            raise ValueError("trainer.kl.reward_level places the KL in the reward: set trainer.kl.in_reward")
        if self.target is not None and not self.in_reward:
            raise ValueError("trainer.kl.target adapts the KL coefficient in the reward: set trainer.kl.in_reward")
        if self.ref_sync_steps is not None and not self.enabled:
            raise ValueError("trainer.kl.ref_sync_steps refreshes the reference of a KL term: set trainer.kl.estimator "
                             "and trainer.kl.coef > 0, or leave trainer.kl.ref_sync_steps out")
        if self.bias_correction and self.in_reward:
            raise ValueError("trainer.kl.bias_correction weights the KL term of the loss; with trainer.kl.in_reward "
                             "there is none")
        return self


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters on the policy (peft; trainer/lora.py): only the adapters train, the base stays frozen."""
    rank: int = Field(0, ge=0)  # 0: off, full fine-tuning
    alpha: float = Field(16.0, gt=0)  # the update is alpha / rank x B @ A
    # The trainer never runs dropout (its log-probs must match the engine's), so adapter dropout stays 0.
    dropout: float = Field(0.0, ge=0, le=0)
    # peft matches these module names; all-linear (veRL's default): every linear layer but the LM head, as peft's
    target_modules: Union[Literal["all-linear"], list[str]] = LORA_TARGETS

    @field_validator("target_modules")
    @classmethod
    def _some_target(cls, targets):
        if not targets:
            raise ValueError("names no module: list the modules to adapt, or all-linear")
        return targets

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class MismatchConfig(Section):
    """Rollout-trainer mismatch correction by rho = pi_old / pi_behav (rlsys/trainer/losses.py)."""
    mode: Literal["none", "tis", "mis"] = "none"  # tis: weight min(rho, threshold); mis: rho, 0 outside the bounds
    level: Literal["token", "sequence"] = "token"  # sequence: rho is the product of the sequence's token ratios
    threshold: float = Field(2.0, ge=1)
    threshold_low: float = Field(0.0, ge=0)  # mis: tokens (sequences) with rho below this are masked too
    warn_kl: Optional[float] = Field(0.01, gt=0)  # warn when a step's k3 KL(pi_behav || pi_old) is above; None: never
    # Rejection sampling (veRL's rollout_rs): drop tokens, or whole sequences, whose statistic of log(pi_old /
    # pi_behav) is out of bounds: k2 and k3 above reject_threshold; k1 = log(pi_behav / pi_old) outside the logs of
    # the ratio bounds [reject_threshold_low, reject_threshold] (veRL's "low_high"). Rejected tokens leave the loss
    # and the step's counts.
    reject: Optional[Literal["k1", "k2", "k3"]] = None
    reject_threshold: float = Field(0.01, gt=0)
    reject_threshold_low: Optional[float] = Field(None, gt=0)  # k1 only; None: 1 / reject_threshold (veRL's)
    # token: each token on its own; seq_mean, seq_sum, seq_max: every token of a sequence on its tokens' mean, sum or
    # max (veRL's seq_*_k*). None: token with level=token, seq_mean with level=sequence.
    reject_level: Optional[Literal["token", "seq_mean", "seq_sum", "seq_max"]] = None

    @property
    def active(self) -> bool:
        """A weight or a rejection is on: the trainer needs its own pi_old."""
        return self.mode != "none" or self.reject is not None

    def describe(self) -> str:
        return f"trainer.mismatch.mode={self.mode}" + (f", reject={self.reject}" if self.reject else "")

    @property
    def rejection_level(self) -> str:
        return self.reject_level or ("token" if self.level == "token" else "seq_mean")

    @property
    def reject_bounds(self) -> tuple[float, float]:
        """k1's ratio bounds on pi_behav / pi_old."""
        low = self.reject_threshold_low if self.reject_threshold_low is not None else 1 / self.reject_threshold
        return low, self.reject_threshold

    @model_validator(mode="after")
    def _bounds(self):
        if self.threshold_low >= self.threshold:
            raise ValueError(f"trainer.mismatch.threshold_low ({self.threshold_low}) must be below "
                             f"trainer.mismatch.threshold ({self.threshold})")
        if self.threshold_low > 0 and self.mode != "mis":
            raise ValueError("trainer.mismatch.threshold_low needs trainer.mismatch.mode=mis: "
                             "tis truncates from above only")
        if (self.reject_threshold_low is not None or self.reject_level is not None) and self.reject is None:
            raise ValueError("trainer.mismatch.reject_threshold_low and reject_level need trainer.mismatch.reject")
        if self.reject_threshold_low is not None and self.reject != "k1":
            raise ValueError(f"trainer.mismatch.reject_threshold_low is k1's lower ratio bound; reject={self.reject} "
                             "has an upper bound only")
        if self.reject == "k1" and self.reject_level == "seq_max":
            raise ValueError("trainer.mismatch.reject=k1 with reject_level=seq_max: k1 is signed, so its maximum "
                             "bounds nothing below (veRL has no seq_max_k1); use k2 or k3")
        low, high = self.reject_bounds
        if self.reject == "k1" and low >= high:
            raise ValueError(f"trainer.mismatch.reject=k1 keeps pi_behav / pi_old within [reject_threshold_low, "
                             f"reject_threshold] = [{low:g}, {high:g}]: the lower bound must be below the upper "
                             "(veRL's ratio bounds, e.g. reject_threshold=2.0)")
        return self


class CriticConfig(Section):
    """PPO's value model (trainer.advantage=gae; trainer/critic.py); defaults as veRL's ppo_trainer critic."""
    lr: float = Field(1e-5, gt=0)  # its own AdamW's (veRL's critic.optim.lr); weight decay is trainer.weight_decay
    grad_clip: float = Field(1.0, ge=0)  # its gradient's norm clip, apart from the policy's trainer.grad_clip
    # veRL's critic_warmup, counted as veRL counts (steps from 1, the policy trains from step N on): the first
    # warmup_steps - 1 steps train the critic alone
    warmup_steps: int = Field(0, ge=0)
    value_clip: float = Field(0.5, gt=0)  # a value moves at most this far from the step's old value (cliprange_value)
    mini_batches: Optional[int] = Field(None, ge=1)  # its optimizer steps per batch; None: trainer.mini_batches
    ppo_epochs: Optional[int] = Field(None, ge=1)  # the critic's passes over each batch; None: trainer.ppo_epochs
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # as trainer.lr_schedule, on the critic's lr
    lr_warmup_steps: Optional[int] = Field(None, ge=0)  # as trainer.lr_warmup_steps (veRL's critic.optim)
    lr_warmup_ratio: float = Field(0.0, ge=0, le=1)  # as trainer.lr_warmup_ratio
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # as trainer.min_lr_ratio


class GAEConfig(Section):
    """Generalised advantage estimation (Schulman et al., 2016) over each response's tokens (trainer/critic.py)."""
    gamma: float = Field(1.0, ge=0, le=1)  # discount per token (veRL's algorithm.gamma)
    lam: float = Field(1.0, ge=0, le=1)  # GAE's lambda: 1 the Monte-Carlo return less the value, 0 one TD step


class TrainerConfig(Section):
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    world_size: int = Field(1, ge=1)
    zero_stage: int = Field(2, ge=0, le=3)
    dtype: Literal["float32", "bf16"] = "float32"  # bf16: bf16 weights and activations, fp32 master weights
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    offload_optimizer: bool = False  # ZeRO 1-3: fp32 master weights and Adam moments in CPU memory
    offload_params: bool = False  # ZeRO-3: bf16/fp32 weights in CPU memory between uses
    total_steps: int = Field(60, ge=1)
    lr: float = Field(1e-4, gt=0)
    # The rate's schedule over trainer.total_steps, stepped once per train step (trainer/schedule.py): constant,
    # cosine (veRL's warmup_style) or linear (TRL's default lr_scheduler_type), each after a linear warm-up
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    lr_warmup_steps: Optional[int] = Field(None, ge=0)  # steps of linear warm-up from 0; None: lr_warmup_ratio's
    lr_warmup_ratio: float = Field(0.0, ge=0, le=1)  # warm-up of int(ratio x total_steps) steps (veRL's, TRL's)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine: the floor, a share of lr, its warm-up's start (veRL's)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    micro_batch_tokens: int = Field(4096, ge=1)  # token budget of one micro-batch (padding counted)
    logprob_chunk_tokens: int = Field(1024, ge=1)  # tokens whose full-vocabulary logits exist at a time
    mini_batches: int = Field(1, ge=1)  # optimizer steps per rollout batch (veRL's PPO mini-batches)
    # passes over each rollout batch, every pass after the first in freshly shuffled mini-batches, pi_old kept from
    # the step's start (veRL's ppo_epochs, TRL's num_iterations)
    ppo_epochs: int = Field(1, ge=1)
    # pi_prox of the later mini-batches of stale samples: recompute (a forward under the step's starting
    # weights) or loglinear (AReaL's interpolation by version between the behaviour log-probs and the
    # mini-batch's own forward: no extra forward; trainer/losses.py)
    proximal: Literal["recompute", "loglinear"] = "recompute"
    # Gradients of completed prompts while the round generates (trainer/streamed.py); control.scheduler=tail only
    streamed: bool = False
    # RollPacker's stream trainer, its artifact's gate (infer_scaling_down_progress_ratio 0.4): once this share of a
    # streamed step's groups is complete, half the engines hand their requests (cut with their tokens, resumed) to
    # the other half and lend their GPUs to the streamed trainer until the step's Train (rlsys/train.py). None: off
    scale_down_at: Optional[float] = Field(None, gt=0, le=1)
    advantage: str = "grpo"
    loss: str = "dapo"
    eps_low: float = Field(0.2, ge=0)
    # None: the loss's own (trainer/losses.py clip_range): DAPO's clip-higher 0.28, or eps_low (symmetric, veRL's)
    eps_high: Optional[float] = Field(None, ge=0)
    # gspo with a token-level mismatch weight: "mean" puts the mean of the sequence's token weights on each
    # token's gradient (TRL), "own" each token's own weight (veRL)
    gspo_token_weights: Literal["mean", "own"] = "mean"
    is_cap: float = Field(5.0, ge=1)  # decoupled_ppo: tokens with pi_prox / pi_behav above this are dropped
    dg_eta: float = Field(1.0, gt=0)  # dg, dg_clipped: temperature of the delight gate
    clip_ratio_c: Optional[float] = Field(None, gt=1)  # dual-clip: A < 0 loses at most -A * c (veRL: 3); None: off
    delta: Optional[float] = Field(None, gt=1)  # two-sided cap: the unclipped ratio at most delta (TRL, INTELLECT-2)
    entropy_coeff: float = Field(0.0, ge=0)  # entropy bonus: - coeff x the policy's entropy per token
    # Train only this share of each micro-batch's response tokens, those of highest entropy (TRL's
    # top_entropy_quantile, "Beyond the 80/20 rule"); None: all.
    top_entropy_share: Optional[float] = Field(None, gt=0, le=1)
    # Off-policy sequence masking (DeepSeek-V3.2): a sequence with A < 0 whose mean log(pi_behav / pi) is above
    # this is dropped; None: off.
    off_policy_mask: Optional[float] = Field(None, ge=0)
    cov_ratio: float = Field(2e-4, gt=0, le=1)  # clip_cov, kl_cov: share of tokens picked by covariance
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)  # clip_cov: covariance range a token is picked from
    kl_cov_coef: float = Field(0.1, ge=0)  # kl_cov: coefficient of |log pi / pi_old| on the picked tokens (veRL's)
    sapo_tau_pos: float = Field(1.0, gt=0)  # sapo: the gate's temperature where A > 0 (veRL's and TRL's default)
    sapo_tau_neg: float = Field(1.05, gt=0)  # sapo: ... where A <= 0
    # Train no token of a completion cut by rollout.max_new_tokens (TRL's); it still counts in its group's advantages
    mask_truncated_completions: bool = False
    # None: the loss's own. token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm |
    # token_sum_norm (trainer/losses.py)
    loss_aggregation: Optional[Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                       "seq_mean_token_sum_norm", "token_sum_norm"]] = None
    loss_scale_tokens: Optional[int] = Field(None, ge=1)  # seq_mean_token_sum_norm's divisor; None: max_new_tokens
    mismatch: MismatchConfig = MismatchConfig()
    kl: KLConfig = KLConfig()
    lora: LoraConfig = LoraConfig()
    critic: CriticConfig = CriticConfig()  # trainer.advantage=gae only
    gae: GAEConfig = GAEConfig()  # trainer.advantage=gae only
    seed: int = 0

    @model_validator(mode="after")
    def _loglinear_without_a_correction(self):
        if self.proximal == "loglinear" and self.mismatch.active:
            raise ValueError(f"trainer.proximal=loglinear interpolates pi_old from the engine's log-probs, and "
                             f"{self.mismatch.describe()} corrects against the trainer's own: "
                             "use trainer.proximal=recompute with a correction")
        return self

    @model_validator(mode="after")
    def _lr_schedules(self):
        for prefix, section in (("trainer", self), ("trainer.critic", self.critic)):
            if section.lr_warmup_steps is not None and section.lr_warmup_ratio:
                raise ValueError(f"{prefix}.lr_warmup_steps and {prefix}.lr_warmup_ratio both set the warm-up: "
                                 "set one")
            if section.min_lr_ratio and section.lr_schedule != "cosine":
                raise ValueError(f"{prefix}.min_lr_ratio is the cosine schedule's floor; {prefix}.lr_schedule is "
                                 f"{section.lr_schedule}: set {prefix}.lr_schedule=cosine or leave it out")
        return self

    @model_validator(mode="after")
    def _precision_and_offload(self):
        if self.backend == "torch" and (self.dtype != "float32" or self.offload_optimizer or self.offload_params):
            raise ValueError("trainer.dtype=bf16, trainer.offload_optimizer and trainer.offload_params need "
                             "trainer.backend=deepspeed")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"trainer.offload_params needs trainer.zero_stage=3 (got {self.zero_stage}): "
                             "only ZeRO-3 partitions the weights")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("trainer.offload_optimizer needs trainer.zero_stage of 1, 2 or 3 (got 0)")
        return self

    @model_validator(mode="after")
    def _lora(self):
        if not self.lora.enabled:
            return self
        if self.kl.ref_sync_steps is not None:
            raise ValueError("trainer.lora: the KL reference is the base model with the adapters off, which "
                             "trainer.kl.ref_sync_steps cannot move: leave trainer.kl.ref_sync_steps out")
        if self.backend == "deepspeed" and self.zero_stage == 3:
            raise ValueError("trainer.lora needs trainer.zero_stage of 0, 1 or 2 (got 3): the adapters are merged "
                             "into whole base weights, which ZeRO-3 partitions")
        return self

    @model_validator(mode="after")
    def _gae(self):
        if self.advantage != "gae":
            # set away from their defaults (a run's saved config.yaml holds every key, so set alone is not enough)
            if self.critic != CriticConfig() or self.gae != GAEConfig():
                raise ValueError(f"trainer.critic and trainer.gae configure PPO's value model: they need "
                                 f"trainer.advantage=gae (got {self.advantage})")
            return self
        refused = {"trainer.lora": self.lora.enabled, "trainer.streamed": self.streamed,
                   "trainer.loss=gmpo": self.loss == "gmpo",
                   "trainer.off_policy_mask": self.off_policy_mask is not None}
        named = [name for name, on in refused.items() if on]
        if named:  # the critic is a full model; the rest read one advantage per sequence or per finished group
            raise ValueError(f"trainer.advantage=gae cannot run with {', '.join(named)}: the critic trains every "
                             "weight (no LoRA), GAE whitens over the whole step (not streamed), and its advantages "
                             "differ token by token (gmpo and off_policy_mask read one per sequence)")
        return self

    @model_validator(mode="after")
    def _streamed(self):
        if not self.streamed:
            return self
        if self.ppo_epochs > 1:  # a streamed batch is gone once trained: nothing is left for a second pass
            raise ValueError(f"trainer.streamed trains each group once, as it completes: trainer.ppo_epochs="
                             f"{self.ppo_epochs} needs trainer.streamed=false")
        if self.kl.in_reward:  # the reward's KL needs a reference forward before the gradients
            raise ValueError("trainer.streamed takes gradients as groups complete; trainer.kl.in_reward needs the "
                             "whole batch's reference forward first: use one or the other")
        # A streamed mini-batch after the first trains on weights that already moved: the step's starting
        # weights are gone, so its pi_prox cannot be recomputed (trainer/streamed.py).
        if self.mini_batches > 1 and self.mismatch.active:
            raise ValueError(f"trainer.streamed with trainer.mini_batches={self.mini_batches}: the mini-batches "
                             f"after the first train on moved weights, so pi_old cannot be recomputed, and "
                             f"{self.mismatch.describe()} corrects against the trainer's own pi_old: use "
                             "trainer.mini_batches=1 or trainer.streamed=false with a correction")
        return self


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: drop groups whose rewards are all equal, refill with extra rounds."""
    enabled: bool = False
    max_extra_rounds: int = Field(2, ge=0)


class TailConfig(Section):
    """RollPacker tail batching: a short round over-draws whole prompts and trains the first P to complete."""
    eta_p: float = Field(1.25, ge=1)  # prompts drawn per short round = ceil(eta_p * prompts_per_step)
    # A deferred prompt waits at most this many policy versions: then the next round is a long one. 4 is the
    # queue's own refill time at the default eta_p (each short round defers a quarter of P), so it binds only
    # where eta_p is nearer 1 or P changes; each long round runs without speculation.
    max_wait_steps: int = Field(4, ge=1)
    # A long round keeps at most this many samples generating (None: all at once). Its prompts are the
    # longest, so admitting them all overflows the engines' KV caches and vLLM pre-empts and recomputes;
    # set it to the engines' KV tokens over a long sample's tokens (the simulator derives it so).
    long_round_samples: Optional[int] = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _whole_groups(cls, data):
        if isinstance(data, dict) and "eta_r" in data:
            raise ValueError("control.tail.eta_r is gone: tail no longer over-samples a prompt and keeps the first "
                             "R samples to finish, which trained every group without its slowest (often longest) "
                             "answers; each prompt is trained with its whole group of R. Remove it; "
                             "control.tail.eta_p over-draws whole prompts")
        return data


class SAGCConfig(Section):
    """Straggler-aware group control: G_t = argmax V*U(G) - Q_t*p(G) over `sizes` (docs/design.md "SAGC")."""
    sizes: list[int] = [4, 8, 16]  # allowed group sizes
    delta: float = Field(0.5, ge=0, le=1)  # budget on the long-run straggler rate (G 4 meets it on cot_sum)
    v: float = Field(0.1, gt=0)  # V, the weight of utility against the straggler queue (see docs/algorithms.md: SAGC)
    utility: Literal["informative", "log"] = "informative"
    prompt_rule: Literal["constant_samples", "constant_prompts"] = "constant_samples"
    prior_tail_share: float = Field(0.02, ge=0, le=1)  # prior share of samples over kappa x median
    prior_samples: float = Field(64.0, ge=0)  # weight of the priors, in samples
    decay: float = Field(0.99, gt=0, le=1)  # per-step discount of old observations

    @model_validator(mode="after")
    def _sizes_usable(self):
        if not self.sizes or min(self.sizes) < 2 or len(set(self.sizes)) != len(self.sizes):
            raise ValueError("control.sagc.sizes must be distinct group sizes of at least 2")
        return self


class SortedConfig(Section):
    """SortedRL: oversubscribed rollout groups, trained in finish order (docs/design.md "SortedRL")."""
    mode: Literal["on_policy", "partial"] = "on_policy"  # unfinished samples at an update: regenerate | resume
    rollout_prompts: Optional[int] = Field(None, ge=1)  # prompts per rollout group; None: 4 x update_prompts
    update_prompts: Optional[int] = Field(None, ge=1)  # prompts per Train; None: the group sizer's prompts
    max_versions: int = Field(2, ge=1)  # K (partial mode): policy versions a trained sample may span

    @model_validator(mode="after")
    def _rollout_covers_update(self):
        if self.rollout_prompts and self.update_prompts and self.rollout_prompts < self.update_prompts:
            raise ValueError("control.sorted.rollout_prompts must be at least control.sorted.update_prompts")
        return self


class StalenessConfig(Section):
    """The `async` scheduler: rollout overlaps training, samples at most `eta` versions old."""
    eta: int = Field(1, ge=0)  # 0 is the synchronous schedule


class ControlConfig(Section):
    scheduler: str = "sync"
    group_sizer: str = "fixed"
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = 8  # at least 2: see _groups_can_be_informative
    straggler_kappa: float = Field(2.0, gt=1)
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    tail: TailConfig = TailConfig()
    sagc: SAGCConfig = SAGCConfig()
    sorted: SortedConfig = SortedConfig()
    staleness: StalenessConfig = StalenessConfig()
    eval_every: int = Field(10, ge=0)  # and before and after training; 0: no eval at all
    save_every: int = Field(20, ge=0)  # 0: only at the end

    @field_validator("group_size")
    @classmethod
    def _groups_can_be_informative(cls, value: int) -> int:
        # An advantage is a reward relative to its group's others: alone, a sample's is 0 (and dynamic sampling
        # would drop every group of one, forever). sagc's sizes are at least 2 already.
        if value < 2:
            raise ValueError("must be at least 2: a group of one sample has no advantage (its reward less its "
                             "group's mean is 0), so nothing would be learned")
        return value

    @model_validator(mode="after")
    def _async_keeps_its_batch(self):
        # async bounds staleness in batches of prompts_per_step prompts, so it cannot follow a sizer that
        # changes the prompt count: it would silently train G x B samples per update instead
        if self.scheduler == "async" and self.group_sizer == "sagc" and self.sagc.prompt_rule != "constant_prompts":
            raise ValueError("control.sagc.prompt_rule: control.scheduler=async trains control.prompts_per_step "
                             "prompts per update whatever G is; set control.sagc.prompt_rule=constant_prompts")
        return self


class ClusterConfig(Section):
    address: Optional[str] = None  # None starts a local Ray cluster; "auto" joins a running one
    num_cpus: Optional[int] = Field(None, ge=1)
    dashboard_host: str = "127.0.0.1"
    # GPU placement (rlsys/placement.py), planned as a run's config loads (startup.py). gpus_per_node 0: none.
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    layout: Literal["colocated", "separate"] = "colocated"  # engines and trainer share GPUs, or not
    # The GPUs' kind, whose memory the per-GPU memory plan is held to (rlsys/memory.py): the names of rlsys.costs.GPUS
    gpu: Literal["a100", "h100", "h800", "h200", "h20", "b200"] = "h100"
    # torch threads per CPU actor (rollout and trainer). One thread each avoids oversubscribing cores
    # that the other actors share; oversubscribed CPU kernels ran many times slower here.
    torch_threads: int = Field(1, ge=1)

    @property
    def colocated_on_gpus(self) -> bool:
        """Engines and trainer ranks share GPUs."""
        return bool(self.gpus_per_node) and self.layout == "colocated"


class WeightsConfig(Section):
    """How each new version of the weights travels from the trainer to the rollout engines (rlsys/weights/)."""
    # object_store: Ray's object store, any placement. broadcast: trainer rank 0 to every engine at once over a
    # process group of their own (NCCL between GPUs, gloo on CPU). cuda_ipc: each trainer rank shares its GPU
    # buffers with the engine on the same GPU (cluster.layout=colocated).
    transfer: Literal["object_store", "broadcast", "cuda_ipc"] = "object_store"
    bucket_mb: float = Field(256, gt=0)  # one message per bucket: the extra memory a transfer holds at a time
    timeout_s: float = Field(600, gt=0)  # joining the weight group, or one update, not done by then fails naming who
    # At each new version, requests still generating either recompute their KV cache under the new weights
    # (a prefill each) or keep the cache the old weights wrote (Completion.stale_kv_tokens counts what follows).
    running_requests: Literal["recompute", "keep"] = "recompute"


class LoggingConfig(Section):
    """Where a run's metrics go besides OUTPUT_DIR/metrics.jsonl, which is always written."""
    progress: bool = True  # a progress bar of the steps, with the last eval accuracy, reward and step time
    # TensorBoard event files in OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR`); needs the `logging`
    # extra (`make setup EXTRAS=dev,logging`), checked as the config loads
    tensorboard: bool = False
    # Weights & Biases: needs the `logging` extra and a login (`wandb login`, or WANDB_API_KEY), or WANDB_MODE=offline
    # (files under OUTPUT_DIR/wandb, `wandb sync` later), checked as the config loads
    wandb: bool = False
    wandb_project: str = "rlsys"  # the W&B project; the run is named after OUTPUT_DIR


class FrictionConfig(Section):
    """A testbed for staleness-robust losses (docs/design.md "Friction"): contaminated training samples, as
    the Delightful Policy Gradient paper studies them. All off by default; eval is never touched. Each
    sample is picked by a hash of (run seed, request id), so a rerun contaminates the same samples."""
    reward_flip: float = Field(0.0, ge=0, le=1)  # share of training rewards replaced by 1 - reward
    wrong_temperature_share: float = Field(0.0, ge=0, le=1)  # share of samples drawn at wrong_temperature...
    wrong_temperature: float = Field(2.0, gt=0)  # ...whose recorded log-probs claim rollout.temperature

    @property
    def on(self) -> bool:
        return self.reward_flip > 0 or self.wrong_temperature_share > 0


class EmulateConfig(Section):
    """Live runs on a GPU's clock (rlsys/emulate.py): the built-in engine, the trainer and the weight publish hold
    each step until the cost model's time (rlsys/costs.py) for `model` on `gpu`, times `time_scale`, has passed.
    Tokens, rewards and gradients stay real. Off while `gpu` is None."""
    gpu: Optional[Literal["a100", "h100", "h800", "h200", "h20", "b200"]] = None  # the names of rlsys.costs.GPUS
    model: Literal["qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"] = "qwen2.5-7b"  # rlsys.costs.MODELS
    time_scale: float = Field(1.0, gt=0)  # wall seconds per emulated second: room for the real compute to fit
    tokens_per_token: int = Field(1, ge=1)  # k: a token of the run's model stands for k of the emulated one
    prompt_tokens: Optional[int] = Field(None, ge=1)  # what each prompt stands for, set on its own; None: k a token
    tp: int = Field(1, ge=1)  # GPUs per emulated rollout engine
    trainer_gpus: Optional[int] = Field(None, ge=1)  # emulated GPUs the trainer's ranks share, where `gpus` is unset
    # (8 if this is unset too)
    # The run's GPU budget (rlsys/emulate.py Budget): engines on the first, the trainer on all of them (colocated,
    # contending with the engines) or on the rest (separate). Unset: engines and trainer_gpus each their own.
    gpus: Optional[int] = Field(None, ge=1)
    layout: Literal["colocated", "separate"] = "colocated"
    # Colocated, how an engine and the trainer share a GPU (docs/design.md "Emulated clock"): sleep, each switch
    # between them copies the side leaving to host memory and the side arriving back (vLLM's sleep mode, as veRL
    # and OpenRLHF colocate); resident, both stay, no switch, and the engine's KV is what the trainer leaves.
    # None picks as a GPU run must: resident where the schedule generates while it trains, else sleep
    colocation: Optional[Literal["sleep", "resident"]] = None
    overrun_limit: float = Field(0.05, ge=0, le=1)  # a run whose overrun share passes this is not emulating

    @property
    def on(self) -> bool:
        return self.gpu is not None


class Config(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    control: ControlConfig = ControlConfig()
    cluster: ClusterConfig = ClusterConfig()
    weights: WeightsConfig = WeightsConfig()
    logging: LoggingConfig = LoggingConfig()
    friction: FrictionConfig = FrictionConfig()
    emulate: EmulateConfig = EmulateConfig()
    tools: ToolsConfig = ToolsConfig()
    output_dir: str = "runs/tiny"
    seed: int = 0

    @model_validator(mode="after")
    def _friction_can_lie(self):
        """A sampler that lies about its temperature needs the built-in engine (it records the claimed log-prob)
        and plain temperature sampling (a nucleus at one temperature is not a claim at another)."""
        f, r = self.friction, self.rollout
        if f.wrong_temperature_share and (r.engine != "cpu" or r.temperature == 0 or r.top_p < 1):
            raise ValueError("friction.wrong_temperature_share needs rollout.engine=cpu, rollout.temperature > 0 "
                             f"and rollout.top_p=1 (got {r.engine}, {r.temperature}, {r.top_p})")
        return self

    @model_validator(mode="after")
    def _emulated_engine_paces(self):
        if self.emulate.on and self.rollout.engine != "cpu":
            raise ValueError(f"emulate.gpu={self.emulate.gpu} paces the built-in engine only: it needs "
                             f"rollout.engine=cpu (got {self.rollout.engine})")
        e = self.emulate
        if e.on and e.gpus is not None and e.trainer_gpus is not None:
            raise ValueError(f"emulate.trainer_gpus={e.trainer_gpus} with emulate.gpus={e.gpus}: the budget's "
                             "layout gives the trainer its GPUs (emulate.layout); remove emulate.trainer_gpus")
        return self

    @model_validator(mode="after")
    def _cot_sum_scored_on_its_value(self):
        # cot_sum's and reason's answers are direct or worked (rlsys/data/cot_tasks.py, reason_tasks.py): only their
        # final values compare
        if self.data.task in ("cot_sum", "reason") and "final_value" not in self.reward.names:
            raise ValueError(f"data.task={self.data.task} is answered directly or as a worked chain, both right when "
                             f"the value after the last '=' is: it needs reward.fn=final_value (got {self.reward.fn})")
        return self

    @model_validator(mode="after")
    def _streamed_under_tail(self):
        # Only tail announces the groups of its next Train while the round generates (Accumulate): under any other
        # scheduler nothing would stream and the step would train exactly as without trainer.streamed.
        if self.trainer.streamed and self.control.scheduler != "tail":
            raise ValueError(f"trainer.streamed=true needs control.scheduler=tail (got control.scheduler="
                             f"{self.control.scheduler}): only tail batching hands its groups to the trainer as they "
                             "complete, so nothing would stream; set control.scheduler=tail or trainer.streamed=false")
        return self

    @model_validator(mode="after")
    def _scale_down_lends_engines_to_the_streamed_trainer(self):
        at, t, e = self.trainer.scale_down_at, self.trainer, self.emulate
        if at is None:
            return self
        if not t.streamed or self.control.scheduler != "tail":
            raise ValueError(f"trainer.scale_down_at={at} lends half the engines' GPUs to the streamed trainer: it "
                             f"needs trainer.streamed=true and control.scheduler=tail (got trainer.streamed="
                             f"{str(t.streamed).lower()}, control.scheduler={self.control.scheduler})")
        if self.rollout.num_workers < 2:
            raise ValueError(f"trainer.scale_down_at={at} moves half the engines' requests to the other half: it "
                             f"needs rollout.num_workers >= 2 (got {self.rollout.num_workers})")
        if self.cluster.layout == "separate" or (e.on and (e.gpus is None or e.layout == "separate")):
            raise ValueError(f"trainer.scale_down_at={at} lends engines' GPUs to the trainer, so the trainer must "
                             "stand on them: it needs cluster.layout=colocated and, emulated, emulate.gpus with "
                             f"emulate.layout=colocated (got cluster.layout={self.cluster.layout}, emulate.gpus="
                             f"{e.gpus}, emulate.layout={e.layout})")
        return self

    @model_validator(mode="after")
    def _colocated_engines_sleep(self):
        """Engines sharing GPUs with the trainer sleep while it trains (rlsys/train.py); None picks that."""
        r, c = self.rollout, self.cluster
        if r.enable_sleep_mode is None:
            r.enable_sleep_mode = c.colocated_on_gpus
        problem = colocated_sleep_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _emulated_colocation(self):
        """Emulated engines share the trainer's GPUs as they could on real ones: asleep only where no request
        generates while the trainer trains (an engine asleep cannot); None picks."""
        e, busy = self.emulate, generates_while_training(self)
        if e.colocation is None:
            e.colocation = "resident" if busy else "sleep"
        elif e.on and e.colocation == "sleep" and busy and e.gpus is not None and e.layout == "colocated":
            raise ValueError(f"emulate.colocation=sleep: {busy}, and an engine asleep cannot generate (on real GPUs "
                             "rollout.enable_sleep_mode is refused alike); use emulate.colocation=resident or "
                             "emulate.layout=separate")
        return self

    @model_validator(mode="after")
    def _dr_grpo_constant(self):
        # Dr.GRPO divides every sequence's token sum by one constant, the longest response the engine writes
        if self.trainer.loss_scale_tokens is None:
            self.trainer.loss_scale_tokens = self.rollout.max_new_tokens
        return self

    @model_validator(mode="after")
    def _transfer_fits_placement(self):
        w, c, r = self.weights, self.cluster, self.rollout
        if w.transfer == "broadcast" and r.on_gpu and c.colocated_on_gpus:
            raise ValueError("weights.transfer=broadcast with cluster.layout=colocated puts a trainer rank and an "
                             "engine on one GPU, and NCCL refuses two ranks of a group on one GPU: use "
                             "weights.transfer=cuda_ipc (colocated) or cluster.layout=separate")
        if w.transfer != "cuda_ipc":
            return self
        if not (c.colocated_on_gpus and r.on_gpu):
            raise ValueError(f"weights.transfer=cuda_ipc shares GPU memory between a trainer rank and the engine on "
                             f"its GPU: it needs cluster.gpus_per_node >= 1, cluster.layout=colocated and the engine "
                             f"on the GPU (rollout.engine=vllm, or rollout.engine=cpu with rollout.device=cuda) (got "
                             f"cluster.gpus_per_node={c.gpus_per_node}, cluster.layout={c.layout}, rollout.engine="
                             f"{r.engine}, rollout.device={r.device}); weights.transfer="
                             "object_store or broadcast run without GPUs")
        if self.trainer.world_size < r.num_workers * r.tensor_parallel_size:
            raise ValueError(f"weights.transfer=cuda_ipc needs a trainer rank on every engine GPU: trainer.world_size="
                             f"{self.trainer.world_size} is less than rollout.num_workers x "
                             f"rollout.tensor_parallel_size = {r.num_workers * r.tensor_parallel_size}")
        return self


COLOCATED_MAX_GPU_SHARE = 0.9  # of a GPU, for a colocated vLLM engine: see Config._colocated_engines_sleep


def colocated_sleep_problem(cfg: "Config") -> str | None:
    """Why the engines of this config cannot share GPUs with the trainer by sleeping, or None if they can."""
    c, r = cfg.cluster, cfg.rollout
    colocated = c.colocated_on_gpus
    where = f"cluster.layout=colocated on GPUs (cluster.gpus_per_node={c.gpus_per_node})"
    if colocated and r.engine == "vllm" and not r.enable_sleep_mode:
        return (f"rollout.enable_sleep_mode=false with rollout.engine=vllm and {where}: vLLM would keep "
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of every GPU while the trainer trains "
                "there; set rollout.enable_sleep_mode=true or cluster.layout=separate")
    if colocated and r.engine == "vllm" and r.gpu_memory_utilization > COLOCATED_MAX_GPU_SHARE:
        return (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} with {where}: while an engine "
                "generates, the trainer rank on its GPU keeps its CUDA context and ZeRO shards there; leave it "
                f"room with at most {COLOCATED_MAX_GPU_SHARE}")
    if not r.enable_sleep_mode:
        return None
    # vLLM awake holds most of the GPU (refused above); the built-in engine can stay beside the trainer
    awake = ("cluster.layout=separate" if r.engine == "vllm" else
             "rollout.enable_sleep_mode=false (the built-in engine then stays on the GPU beside the trainer), or "
             "cluster.layout=separate")
    busy = generates_while_training(cfg)
    return f"rollout.enable_sleep_mode: {busy}, and a sleeping engine cannot generate; use {awake}" if busy else None


def generates_while_training(cfg: "Config") -> str | None:
    """Why this schedule keeps engines generating while the trainer trains, so that an engine on a trainer's GPU
    cannot sleep; None where it does not."""
    sched = cfg.control
    if sched.scheduler == "async" and sched.staleness.eta > 0:
        return (f"control.scheduler=async with control.staleness.eta={sched.staleness.eta} keeps requests "
                "generating while the trainer trains")
    if cfg.trainer.streamed:
        return "trainer.streamed computes gradients while the engines generate"
    return None


class ConfigError(ValueError):
    """A mistake in a config file or override, naming the field and where it was set. A user's error, as
    rlsys/errors.py's are (the command prints it alone), but defined here: the schema imports nothing of rlsys."""


_DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")  # a dotted field as messages name it: trainer.world_size


def _yaml_line(text: str, loc: tuple, exact: bool = False) -> int | None:
    """The line of a dotted key in a YAML text, so errors can point at it; missing, its section's line (or None
    if `exact`)."""
    node = yaml.compose(text)
    line = None
    for key in loc:
        match = [(k, v) for k, v in node.value if k.value == str(key)] if isinstance(node, yaml.MappingNode) else []
        if not match:
            return None if exact else line
        line, node = match[0][0].start_mark.line + 1, match[0][1]
    return line


@dataclass(frozen=True)
class ConfigSource:
    """Where a config's values were set (its file's text, the command-line overrides), so errors point there."""
    path: Path
    text: str
    overrides: dict

    def error(self, problems: list[tuple[tuple, str, str]]) -> ConfigError:
        """One error for these problems, each (location of the field, message, what it got or ""), with the
        dotted field and where it was set (file line or override). A problem of several fields together (the
        location ()) says where each field its message names was set."""
        lines = []
        for loc, msg, got in problems:
            if loc:
                line = _yaml_line(self.text, loc)
                where = ".".join(str(p) for p in loc)
                origin = "command-line override" if _has_dotted(self.overrides, loc) else (
                    f"{self.path}, line {line}" if line else str(self.path))
            else:
                where, origin = "(several fields)", self._origins(msg)
            lines.append(f"  {where}: {msg}{got} [{origin}]" + (_nearest_key(loc) if msg == "unknown key" else ""))
        return ConfigError("invalid config:\n" + "\n".join(lines))

    def _origins(self, msg: str) -> str:
        """Where the fields `msg` names were set: `FILE: a.b line 3, ...; command-line override: c.d`."""
        named = dict.fromkeys(m for m in _DOTTED.findall(msg) if m.split(".")[0] in Config.model_fields)
        overridden = [f for f in named if _has_dotted(self.overrides, tuple(f.split(".")))]
        in_file = [f"{f} line {line}" for f in named if f not in overridden
                   and (line := _yaml_line(self.text, tuple(f.split(".")), exact=True))]
        parts = [f"{self.path}: {', '.join(in_file)}" if in_file else "",
                 f"command-line override: {', '.join(overridden)}" if overridden else ""]
        return "; ".join(filter(None, parts)) or f"{self.path}: their defaults"


def _nearest_key(loc: tuple) -> str:
    """For an unknown key: "; did you mean" the nearest key of its section, where one is near (trainer.total_step)."""
    section: Any = Config
    for key in loc[:-1]:
        field = section.model_fields.get(key) if isinstance(section, type) and issubclass(section, BaseModel) else None
        section = field.annotation if field else None
    known = list(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
    near = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return f"; did you mean {'.'.join(map(str, (*loc[:-1], near[0])))}?" if near else ""


def format_errors(err: ValidationError, source: ConfigSource) -> ConfigError:
    """A config's validation errors as one ConfigError (ConfigSource.error)."""
    return source.error([(e["loc"], "unknown key" if e["type"] == "extra_forbidden" else e["msg"],
                          # what the field got, unless that is the whole file
                          "" if e["type"] == "missing" or not e["loc"] else f" (got {e.get('input')!r})")
                         for e in err.errors()])


def _has_dotted(tree: dict, loc: tuple) -> bool:
    for key in loc:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {k} is not a section")
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """`trainer.total_steps=2 output_dir=/tmp/run` -> nested dict; values parsed as YAML scalars."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.total_steps=2)")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml_mapping(path: Path, what: str = "config file") -> tuple[dict, str]:
    """(parsed mapping, raw text) of a YAML file, or a ConfigError naming the file."""
    try:
        text = path.read_text()
        _refuse_repeated_keys(yaml.compose(text), path)
        raw = yaml.safe_load(text) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw, text


def _refuse_repeated_keys(node, path: Path) -> None:
    """YAML keeps the last of two equal keys without a word; a config must not change silently."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key, value in node.value:
            if key.value in seen:
                raise ConfigError(f"{path}: line {key.start_mark.line + 1}: key {key.value!r} repeats the one "
                                  f"on line {seen[key.value] + 1}")
            seen[key.value] = key.start_mark.line
            _refuse_repeated_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, path)


def split_config_and_overrides(items: list[str]) -> tuple[str, list[str]]:
    """`[config.yaml] key=value ...` (train, bench): the config file, the default one if none is named, and the
    overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return str(DEFAULT_CONFIG), items


SIM_KEYS = {"schedulers", "workload"}  # sections only a simulator config has (rlsys/sim/config.py)


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[Config, ConfigSource]:
    """The config of a file (the default one for None) with `key=value` overrides, checked against the schema,
    and where its values came from. A run loads its config with rlsys.startup.load_run_config, which adds the
    checks that need the rest of rlsys."""
    path = Path(path) if path else DEFAULT_CONFIG
    raw, text = read_yaml_mapping(path)
    if SIM_KEYS & set(raw):
        raise ConfigError(f"{path} is a simulator config (it has {', '.join(sorted(SIM_KEYS & set(raw)))}), not a "
                          f"run's: run it with `rlsys simulate {path}`")
    source = ConfigSource(path, text, parse_overrides(overrides or []))
    try:
        return Config.model_validate(_merge(raw, source.overrides)), source
    except ValidationError as e:
        raise format_errors(e, source) from None


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
