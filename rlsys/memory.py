"""The per-GPU memory plan of a config on GPUs: what one GPU holds while the engines generate and while the trainer
trains, in the sizes of rlsys/costs.py, against the memory of a `cluster.gpu`. `rlsys check` prints it (startup.py
`check_report`); a plan that does not fit is refused as the config loads (startup.py CHECKS), so `rlsys train`
starts nothing. Formulas and their sources: docs/gpu.md "The memory plan".

The model's shape comes from model.path's config.json where that folder is on this machine, else from the table of
rlsys/costs.py by the folder's name (Qwen2.5-7B, Qwen2.5-Math-1.5B, ...), else, for a built model, from model.*.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlsys import costs
from rlsys.costs import CUDA_CONTEXT_BYTES, ENGINE_WORKSPACE_BYTES, ModelShape

GB = 1e9
BUILT_VOCAB = 259  # the built model's character tokenizer (rlsys/models/tiny.py): 256 bytes, pad, eos, unk
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def advice(name: str, t, r) -> str | None:
    """The fields that shrink part `name` of a side that does not fit, given the config."""
    if name.startswith(("trainer ", "fp32 step")) and "context" not in name:
        if t.world_size == 1:
            return "more GPUs for the trainer to shard its states over (trainer.world_size=1)"
        if t.zero_stage < 3:
            return f"trainer.zero_stage=3 (now {t.zero_stage}: 3 shards weights, gradients and Adam states)"
        return "trainer.offload_optimizer=true" if name != "trainer weights" else "trainer.offload_params=true"
    return {"activations": "trainer.gradient_checkpointing=true" if not t.gradient_checkpointing else
            f"a smaller trainer.micro_batch_tokens (now {t.micro_batch_tokens})",
            "vLLM engine": f"a smaller rollout.gpu_memory_utilization (now {r.gpu_memory_utilization})",
            "engine KV cache": f"fewer rollout.slots (now {r.slots}) or a smaller rollout.max_new_tokens"}.get(name)


@dataclass(frozen=True)
class Side:
    """One GPU during one phase: (what, bytes, how it is counted) each."""
    title: str
    parts: tuple[tuple[str, float, str], ...]

    @property
    def total(self) -> float:
        return sum(b for _, b, _ in self.parts)


@dataclass(frozen=True)
class MemoryPlan:
    gpu: str
    memory: float
    source: str  # where the model's shape came from
    layout: str
    sides: tuple[Side, ...]
    problems: tuple[str, ...]  # each a refusal, with the numbers and the fields to change


def built_model_shape(cfg) -> ModelShape:
    """The shape of the model a run builds from its model.* fields (its head tied to the embedding, as tiny.py's)."""
    m = cfg.model
    return ModelShape.qwen2(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size,
                            BUILT_VOCAB, tied=True)


def model_shape(cfg) -> tuple[ModelShape | None, str]:
    """The policy's shape and where it came from; None and why where neither a config.json nor the table knows it."""
    m = cfg.model
    if not m.path:
        return built_model_shape(cfg), "model.* (a built model)"
    config, why = Path(m.path).expanduser() / "config.json", "no config.json here"
    if config.is_file():
        fields = json.loads(config.read_text())
        if fields.get("num_experts") or fields.get("num_local_experts"):
            return None, f"{config} describes a mixture of experts, which the plan does not model"
        try:
            return ModelShape.of_hf(fields), str(config)
        except KeyError as e:  # not a decoder's config.json: sized by its name, as where there is none
            why = f"{config} lacks {e}"
    found = re.search(r"qwen2\.5-(?:math-|coder-)?(\d+(?:\.\d+)?)b", Path(m.path).name.lower())
    key = found and f"qwen2.5-{found.group(1)}b"
    if key in costs.MODELS:
        return costs.MODELS[key], f"rlsys.costs.MODELS[{key!r}], by the name of model.path ({why})"
    return None, f"model.path={m.path}: {why}, and its name is none of {', '.join(costs.MODELS)} (rlsys/costs.py)"


def engine_parts(cfg, shape: ModelShape, gpu: costs.GPU) -> tuple[list, list, list[str]]:
    """An engine's share of one of its GPUs awake and asleep, and what keeps it from starting."""
    r, c = cfg.rollout, cfg.cluster
    tp, max_len = r.tensor_parallel_size, cfg.data.max_prompt_tokens + r.max_new_tokens
    size = DTYPE_BYTES[r.engine_dtype]
    weights = shape.params * size / tp
    per_token = shape.kv_bytes_per_token * size / costs.BF16 / tp
    kv_how = (f"{shape.layers} layers x {shape.kv_heads} kv_heads x {shape.head_dim} head_dim x 2 (K, V) x {size} "
              f"bytes{f' / TP {tp}' if tp > 1 else ''} = {per_token / 1e3:.1f} KB a token")
    if r.engine == "vllm":
        reserved = r.gpu_memory_utilization * gpu.memory
        room = reserved - weights - ENGINE_WORKSPACE_BYTES
        full = int(max(room, 0) // (per_token * max_len))
        awake = [("vLLM engine", reserved,
                  f"rollout.gpu_memory_utilization {r.gpu_memory_utilization} x {gpu.memory / GB:.0f} GB: weights "
                  f"{weights / GB:.1f}, workspace {ENGINE_WORKSPACE_BYTES / GB:.0f} (assumed), KV cache "
                  f"{max(room, 0) / GB:.1f} = {max(room, 0) / per_token / 1e3:,.0f}k tokens of {kv_how}: "
                  f"{min(full, r.slots)} of the {r.slots} rollout.slots at {max_len:,} tokens"
                  + (" (vLLM preempts past that)" if full < r.slots else ""))]
        problems = [] if full >= 1 else [
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of a {c.gpu} leaves the vLLM engine "
            f"{max(room, 0) / GB:.1f} GB of KV cache after its {weights / GB:.1f} GB of weights and "
            f"{ENGINE_WORKSPACE_BYTES / GB:.0f} GB of workspace, less than one sequence of data.max_prompt_tokens + "
            f"rollout.max_new_tokens = {max_len:,} tokens ({per_token * max_len / GB:.2f} GB): vLLM would refuse to "
            "start; raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size, or shorten the sequences"]
        return awake, [("vLLM engine asleep", CUDA_CONTEXT_BYTES, "its CUDA context: sleep level 2 frees its weights "
                        "and KV cache (rlsys/train.py)")], problems
    positions = max_len + 1 if cfg.model.path else min(max_len, cfg.model.max_position_embeddings) + 1
    kv = per_token * positions * r.slots
    weights_part = ("engine weights", weights, f"{shape.params / 1e9:.2f}B x {size} bytes")
    context = ("engine CUDA context", CUDA_CONTEXT_BYTES, "from the smoke run on an H100")
    awake = [weights_part, ("engine KV cache", kv, f"{kv_how} x {positions:,} positions x {r.slots} rollout.slots "
                            "(the built-in engine's static cache)"), context]
    asleep = [weights_part, context] if r.enable_sleep_mode else awake
    return awake, asleep, []


def trainer_parts(cfg, shape: ModelShape) -> tuple[list, list]:
    """A trainer rank's GPU: what it holds between steps, and what it adds at its peak in backward."""
    t = cfg.trainer
    zero = t.zero_stage if t.backend == "deepspeed" else 0
    size = 2 if t.dtype == "bf16" else 4
    states = costs.trainer_parts(shape, t.world_size, zero, size, t.offload_optimizer, t.offload_params)
    if t.lora.enabled:  # only the adapters train: their gradients and moments are a fraction of a percent
        states = {**states, "gradients": 0.0, "optimizer": 0.0}
    n, shard = f"{shape.params / 1e9:.2f}B", f" / {t.world_size} (ZeRO-{zero})"
    how = {"weights": f"{n} x {size} bytes" + (shard if zero >= 3 else ""),
           "gradients": f"{n} x {size} bytes" + (shard if zero >= 2 else ""),
           "optimizer": f"{n} x {costs.optimizer_bytes(size)} bytes (" + ("fp32 master, " if size == 2 else "")
           + "momentum, variance)" + (shard if zero >= 1 else "")}
    if t.offload_params:
        how["weights"] = "offloaded to host memory (trainer.offload_params)"
    if t.offload_optimizer:
        how["optimizer"] = "offloaded to host memory (trainer.offload_optimizer)"
    if t.lora.enabled:
        how["gradients"] = how["optimizer"] = "LoRA: the adapters' only, left out"
    held = [(f"trainer {k}", v, how[k]) for k, v in states.items()]
    if t.kl.enabled:
        held.append(("KL reference weights", states["weights"] or shape.params * size, "a frozen copy of the weights"))
    if t.advantage == "gae":
        held.append(("critic states", sum(costs.trainer_parts(shape, t.world_size, zero, size).values()),
                     "the value model's weights, gradients and optimizer, as the policy's"))
    held.append(("trainer CUDA context", CUDA_CONTEXT_BYTES, "from the smoke run on an H100"))
    if not cfg.model.path and cfg.model.warm_start.steps and cfg.model.warm_start.device != "cpu":  # on the GPU
        held.append(("driver CUDA context", CUDA_CONTEXT_BYTES, "model.warm_start.device=cuda: GPU 0 only"))
    tokens, chunk = t.micro_batch_tokens, min(t.logprob_chunk_tokens, t.micro_batch_tokens)
    ckpt = t.gradient_checkpointing
    peak = [("activations", costs.activation_bytes(shape, tokens, ckpt),
             f"trainer.micro_batch_tokens {tokens:,} x " + (f"({shape.layers} layers x {shape.width} width x 2 bytes "
             f"kept + one layer's {costs.layer_activation_bytes(shape) / 1e3:.0f} KB recomputed), gradient "
             "checkpointing" if ckpt else f"{shape.layers} layers x {costs.layer_activation_bytes(shape) / 1e3:.0f} "
             "KB, no gradient checkpointing")),
            ("output head", costs.head_bytes(shape, chunk), f"{chunk:,} tokens x {shape.vocab:,} vocab x 16 bytes + "
             "its fp32 gradient"),
            ("ZeRO buffer", costs.zero_buffer_bytes(shape, zero, size),
             "gathered parameters (ZeRO-3)" if zero == 3 else "gradient reduce bucket (DeepSpeed's default)")]
    if size == 2 and not t.offload_optimizer and not t.lora.enabled:
        peak.append(("fp32 step gradients", costs.step_gradient_bytes(shape, t.world_size, zero),
                     "the gradient partition cast to fp32 for the step (summed with backward's: a bound)"))
    return held, peak


def plan_memory(cfg) -> MemoryPlan | None:
    """The plan of a config whose cluster has GPUs (None without); a plan of no sides where the shape is unknown."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    if not c.gpus_per_node:
        return None
    gpu = costs.GPUS[c.gpu]
    shape, source = model_shape(cfg)
    if shape is None:
        return MemoryPlan(c.gpu, gpu.memory, source, c.layout, (), ())
    held, peak = trainer_parts(cfg, shape)
    awake, asleep, problems = engine_parts(cfg, shape, gpu) if r.on_gpu else ([], [], [])
    if c.layout == "colocated":
        sides = (Side("generating (engine awake, trainer states kept)", tuple(awake + held)),
                 Side("training (engine asleep)" if r.enable_sleep_mode else "training", tuple(asleep + held + peak)))
    else:
        sides = tuple(s for s in (Side("an engine's GPU", tuple(awake)), Side("a trainer rank's GPU",
                                                                               tuple(held + peak))) if s.parts)
    for side in sides:
        if side.total > gpu.memory:
            biggest = sorted(side.parts, key=lambda p: -p[1])
            fixes = list(dict.fromkeys(filter(None, (advice(name, t, r) for name, _, _ in biggest))))[:3]
            problems.append(f"memory plan: {side.title} needs {side.total / GB:.1f} GB on each GPU ("
                            + ", ".join(f"{name} {b / GB:.1f}" for name, b, _ in biggest if b >= GB / 10)
                            + f"), more than the {gpu.memory / GB:.0f} GB of a cluster.gpu={c.gpu}; change: "
                            + "; or ".join(fixes + ["a larger cluster.gpu"]))
    return MemoryPlan(c.gpu, gpu.memory, source, c.layout, sides, tuple(problems))


def check_fits(cfg) -> None:
    """A config whose plan does not fit is refused (a ValueError of every problem)."""
    plan = plan_memory(cfg)
    if plan and plan.problems:
        raise ValueError("\n  ".join(plan.problems))


def format_memory(plan: MemoryPlan) -> str:
    head = f"memory plan per GPU ({plan.gpu}, {plan.memory / GB:.0f} GB; model from {plan.source}):"
    if not plan.sides:
        return f"{head} not made"
    lines = [head]
    for side in plan.sides:
        lines.append(f"  {side.title}: {side.total / GB:.1f} GB, {side.total / plan.memory:.0%} of the GPU")
        lines += [f"    {name:<22} {b / GB:6.1f} GB  {how}" for name, b, how in side.parts]
    peak = max(s.total for s in plan.sides)
    lines.append(f"  {'fits' if not plan.problems else 'does NOT fit'}: peak {peak / GB:.1f} of {plan.memory / GB:.0f}"
                 f" GB, headroom {(plan.memory - peak) / GB:.1f} GB ({1 - peak / plan.memory:.0%}); "
                 f"{plan.layout} (docs/gpu.md)")
    return "\n".join(lines)
