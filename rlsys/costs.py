"""Cost model of an H100-class cluster: vLLM decode and prefill, the trainer, and weight sync.

One model, two users: the simulator (rlsys/sim/) and live runs on an emulated clock (rlsys/emulate.py),
so both take their seconds from the functions and defaults here. It imports nothing of rlsys but the built-in
engine's shape buckets (rlsys/rollout/shapes.py, plain Python), by which its padded decode step is charged.

Constants and formulas: docs/performance.md "Calibration sources" (decode with weights read
at 75% of HBM bandwidth, KV reads at 90%, 90% of memory usable; prefill at about 45% of BF16 peak; weight
sync; trainer MFU). Qwen2.5 shapes from arXiv 2412.15115 Table 1. A GPU the engine and the trainer share:
docs/design.md "Emulated clock" (`switch_seconds`, `trainer_bytes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlsys.rollout.shapes import KEYS_FINE, bucket, buckets

BF16 = 2  # bytes

# Defaults of both users (the simulator's config fields start from them)
MEMORY_FRACTION = 0.9  # vLLM gpu_memory_utilization
STEP_OVERHEAD_S = 1e-3  # scheduling and sampling on the CPU, per decode step
DECODE_MFU = 0.5
PREFILL_MFU = 0.45
ALLREDUCE_S = 10e-6  # one tensor-parallel all-reduce (two per layer)
# Per doubling of TP, the share kept of the ideal split of a step's reads and matmuls (sim/calibration_tp.py tp_fit)
TP_EFFICIENCY = 0.94
TRAIN_MFU = 0.35  # ~0.33 on H100 in RL frameworks (docs/performance.md "Calibration sources")
FORWARD_FLOPS = 2  # per parameter and token: one forward pass
TRAIN_FLOPS = 6  # forward and backward
LINK_GBPS = 25.0  # GB/s of full weights, trainer to engines
SYNC_LATENCY_S = 0.2
# A colocated switch copies bytes between the GPU and host memory over the GPU's host link (GPU.host_bandwidth):
# a large pinned copy is taken to reach this share of the link's peak each way (assumed, as the other efficiencies)
HOST_LINK_EFFICIENCY = 0.8
# Adam under mixed precision, bytes a parameter (ZeRO, arXiv 1910.02054 section 3.1): bf16 weights 2 and gradients
# 2, and the optimizer's fp32 master weights, momentum and variance 12; 16 in all
TRAIN_WEIGHT_BYTES, ADAM_BYTES = BF16, 12
# Tokens of a trainer GPU's micro-batch whose activations stay: each layer's input under gradient checkpointing
# (veRL's ppo_max_token_len_per_gpu default, by which it packs micro-batches)
ACTIVATION_TOKENS = 16384
# A live config's per-GPU memory plan (rlsys/memory.py; docs/gpu.md "The memory plan"). Each process on a GPU holds
# a CUDA context with PyTorch's and NCCL's buffers: configs/gpu/smoke.yaml's engine and trainer, whose tensors are a
# few MB, peaked at 3,177 MiB together on an H100 (benchmarks/results/gpu_runs_h100.json). Assumed, as the
# efficiencies: a vLLM engine takes its activations and CUDA graphs out of its reservation before the KV cache.
CUDA_CONTEXT_BYTES, ENGINE_WORKSPACE_BYTES = 1.6e9, 2e9
# DeepSpeed's defaults (0.19, runtime/zero/config.py): ZeRO 0-2 reduce gradients through a bucket of
# reduce_bucket_size elements; ZeRO-3 keeps up to stage3_max_live_parameters gathered parameters
REDUCE_BUCKET_ELEMENTS, ZERO3_LIVE_PARAMS = 5e8, 1e9

# The built-in engine (rlsys/rollout/builtin_engine.py) on CUDA instead of vLLM, its decode step as CUDA graphs
# over static shapes: every row attends over the longest sequence's key bucket (EngineCost.max_len). key_s is the
# attention's walk over those keys, which barely depends on the batch (SDPA's masked kernel: 2 thread blocks a
# sequence; 7.2 ms at 4096 keys for one sequence, 1.8 ms at 128). Least-squares fit of the relative error to every
# point of its H100 grid at 0.47B, skewed ones included (benchmarks/results/gpu_engine_graph_h100.json), by
# benchmarks/builtin_engine_fit.py: the fit and each point's error in builtin_engine_fit_h100.json.
# prefill_mfu: its two largest prefills (8 x 1024 and 32 x 512) within 4%; a smaller one pays a fixed cost
# (7.4 ms for 128 tokens) that the model leaves out. The eager engine's grid (gpu_engine_h100.json) had 7 ms,
# 0.05 and 0.35, with a cost summing the live KV.
BUILTIN_ENGINE = {"overhead_s": 1.46e-3, "decode_mfu": 0.143, "prefill_mfu": 0.30, "key_s": 1.26e-6}


@dataclass(frozen=True)
class GPU:
    memory: float  # bytes of HBM
    bandwidth: float  # bytes/s
    peak_flops: float  # dense BF16
    host_bandwidth: float = 64e9  # bytes/s each way between the GPU and host memory: PCIe Gen5 x16 (128 GB/s both)


GPUS = {  # vendor datasheets, SXM parts (docs/performance.md "The simulator's GPUs")
    "a100": GPU(80e9, 2.039e12, 312e12, 32e9),  # A100 80GB: HBM2e, Ampere tensor cores, PCIe Gen4 x16
    "h100": GPU(80e9, 3.35e12, 989e12),
    "h800": GPU(80e9, 3.35e12, 989e12),  # same HBM and tensor cores as H100 SXM; less NVLink
    "h200": GPU(141e9, 4.8e12, 989e12),
    "h20": GPU(96e9, 4.0e12, 148e12),  # Hopper with H200-class HBM and ~15% of the tensor cores
    "b200": GPU(180e9, 7.7e12, 2250e12),  # HGX B200's per-GPU share: 180 GB HBM3e, 2.25 PFLOP/s dense BF16
}


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    kv_heads: int
    head_dim: int = 128
    hidden: int = 0  # the residual stream's width, for the trainer's activations; 0: unknown, estimated
    intermediate: int = 0  # the MLP's width; 0: unknown, GPT's 4 x width
    vocab: int = 0  # the output head's rows, for the trainer's logits; 0: unknown, left out

    @classmethod
    def qwen2(cls, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
              tied: bool = False, head_dim: int | None = None) -> "ModelShape":
        """A Qwen2-architecture model's shape from its dimensions (q/k/v biases; `tied`: the head is the embedding)."""
        d = head_dim or hidden // heads
        per_layer = hidden * (heads + 2 * kv_heads) * d + (heads + 2 * kv_heads) * d + hidden * heads * d \
            + 3 * hidden * intermediate + 2 * hidden
        embeddings = (1 if tied else 2) * vocab * hidden
        return cls(layers * per_layer + embeddings + hidden, layers, kv_heads, d, hidden, intermediate, vocab)

    @classmethod
    def of_hf(cls, config: dict) -> "ModelShape":
        """From a Hugging Face config.json of a dense decoder (Qwen2, Llama: a Llama's absent q/k/v biases are a
        few thousand parameters)."""
        heads = config["num_attention_heads"]
        return cls.qwen2(config["hidden_size"], config["num_hidden_layers"], heads,
                         config.get("num_key_value_heads") or heads, config["intermediate_size"], config["vocab_size"],
                         bool(config.get("tie_word_embeddings")), config.get("head_dim"))

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16  # K and V, every layer

    @property
    def width(self) -> int:
        """`hidden`, or where unknown the width whose ~12 x width^2 parameters a layer would hold."""
        return self.hidden or round(math.sqrt(self.params / (12 * self.layers)))

    @property
    def ffn(self) -> int:
        return self.intermediate or 4 * self.width


MODELS = {
    "qwen2.5-1.5b": ModelShape(1.54e9, 28, 2, hidden=1536, intermediate=8960, vocab=151936),
    "qwen2.5-7b": ModelShape(7.61e9, 28, 4, hidden=3584, intermediate=18944, vocab=152064),
    "qwen2.5-14b": ModelShape(14.7e9, 48, 8, hidden=5120, intermediate=13824, vocab=152064),
    "qwen2.5-32b": ModelShape(32.5e9, 64, 8, hidden=5120, intermediate=27648, vocab=152064),
}


@dataclass(frozen=True)
class EngineCost:
    """One vLLM instance over `tp` GPUs. A decode step costs

        max(weights / (0.75 BW), n * 2 * params / (peak * decode_mfu)) + live_KV * kv_bytes / (0.9 BW) + overhead

    per GPU: the weight read dominates small batches, the matmuls large ones (roofline), and KV
    reads grow with the live tokens of the batch, which is what makes long-CoT rollout slow.

    An engine whose attention is padded to the longest sequence (the built-in engine's static step: `max_len` set)
    reads K keys for every row instead, K the key bucket of the longest sequence (rlsys/rollout/shapes.py), and
    walks them in `key_s` a key whatever the batch: the KV term is K * (key_s + n * kv_bytes / (0.9 BW)).
    """
    weight_s: float  # seconds per step to stream this GPU's weights
    compute_s_per_seq: float  # seconds per step per running sequence when compute-bound
    kv_s_per_token: float  # seconds per step per live KV token
    overhead_s: float
    prefill_s_per_token: float
    kv_capacity: float  # tokens of KV cache per engine
    key_s: float = 0.0  # padded attention: seconds per step per key of the longest sequence's bucket
    max_len: int = 0  # padded attention: the engine's max_len (its last key bucket); 0: paged, as vLLM

    @classmethod
    def build(cls, model: ModelShape, gpu: GPU, tp: int, memory_fraction: float = MEMORY_FRACTION,
              overhead_s: float = STEP_OVERHEAD_S, decode_mfu: float = DECODE_MFU, prefill_mfu: float = PREFILL_MFU,
              allreduce_s: float = ALLREDUCE_S, tp_efficiency: float = TP_EFFICIENCY, key_s: float = 0.0,
              max_len: int = 0, resident: float = 0.0) -> "EngineCost":
        """`resident`: bytes of each of its GPUs a trainer staying beside the engine holds (colocated, resident
        mode: `trainer_bytes`); its KV cache is what is left."""
        if key_s and not max_len:
            raise ValueError("a padded engine's cost (key_s) needs its max_len, the last key bucket")
        weights = engine_bytes(model, tp)
        kv_token = model.kv_bytes_per_token / tp
        free = memory_fraction * gpu.memory - weights - resident
        if free <= 0 and resident:
            raise ValueError(f"{model.params / 1e9:.1f}B parameters on {tp} GPU(s) and the trainer's "
                             f"{resident / 1e9:.1f} GB resident beside them leave no KV cache")
        if free <= 0:
            raise ValueError(f"{model.params / 1e9:.1f}B parameters do not fit on {tp} GPU(s); raise cluster.tp")
        flops_per_token = 2 * model.params / tp
        # TP shards split a step's reads and matmuls less than perfectly (sync, uneven kernels): each doubling
        # keeps only `tp_efficiency` of the ideal speed-up; tp=1 pays nothing.
        slow = tp_efficiency ** -math.log2(tp)
        return cls(weight_s=slow * weights / (0.75 * gpu.bandwidth),
                   compute_s_per_seq=slow * flops_per_token / (gpu.peak_flops * decode_mfu),
                   kv_s_per_token=slow * kv_token / (0.9 * gpu.bandwidth),
                   overhead_s=overhead_s + (2 * model.layers * allreduce_s if tp > 1 else 0.0),  # 2 per layer
                   prefill_s_per_token=flops_per_token / (gpu.peak_flops * prefill_mfu),
                   kv_capacity=free / kv_token, key_s=key_s, max_len=max_len)

    def fixed_s(self, n: int) -> float:
        """The part of a decode step that does not depend on context length."""
        return max(self.weight_s, n * self.compute_s_per_seq) + self.overhead_s

    def step_s(self, n: int, live_kv: float, longest: float = 0) -> float:
        """A decode step of n sequences over live_kv cached tokens, the longest of them holding `longest` keys
        (read by a padded engine only)."""
        if not self.max_len:
            return self.fixed_s(n) + live_kv * self.kv_s_per_token
        keys = min(math.ceil(longest), self.max_len)  # a fluid simulator's count may pass it by a hair
        return self.fixed_s(n) + bucket(keys, buckets(self.max_len, KEYS_FINE)) * self.growth_s(n)

    def growth_s(self, n: int) -> float:
        """What a step costs more for each step its n sequences take: the live KV grows by n; the longest, which
        a padded engine reads, by one (its bucket taken as growing with it)."""
        return (self.key_s if self.max_len else 0.0) + n * self.kv_s_per_token


def train_gpu_seconds(model: ModelShape, gpu: GPU, tokens: float, mfu: float, flops_per_param_token: float) -> float:
    """FLOPs = k * params * tokens (k = 6 for forward+backward, +2 per extra forward pass), on one GPU."""
    return flops_per_param_token * model.params * tokens / (gpu.peak_flops * mfu)


def sync_seconds(model: ModelShape, bandwidth_gbps: float = LINK_GBPS, latency_s: float = SYNC_LATENCY_S) -> float:
    """Broadcast the full BF16 weights once (7B in 0.55-0.8 s over NCCL: docs/performance.md "Calibration sources")."""
    return model.params * BF16 / (bandwidth_gbps * 1e9) + latency_s


def engine_bytes(model: ModelShape, tp: int) -> float:
    """An engine's BF16 weights on each of its `tp` GPUs."""
    return model.params * BF16 / tp


def trainer_parts(model: ModelShape, gpus: int, zero_stage: int, weight_bytes: int = TRAIN_WEIGHT_BYTES,
                  offload_optimizer: bool = False, offload_params: bool = False) -> dict[str, float]:
    """Each of the trainer's `gpus` GPUs' share of a full fine-tune's states under Adam: weights and gradients at
    `weight_bytes`, and the optimizer's fp32 moments plus, under bf16, its fp32 master weights (ADAM_BYTES). ZeRO
    stage 1 shards the optimizer's over the GPUs, 2 the gradients too, 3 the weights too (arXiv 1910.02054, as
    DeepSpeed does it); an offloaded part sits in host memory."""
    adam = optimizer_bytes(weight_bytes)

    def share(bytes_per_param: int, stage: int, offloaded: bool = False) -> float:
        return 0.0 if offloaded else model.params * bytes_per_param / (gpus if zero_stage >= stage else 1)
    return {"weights": share(weight_bytes, 3, offload_params), "gradients": share(weight_bytes, 2),
            "optimizer": share(adam, 1, offload_optimizer)}


def optimizer_bytes(weight_bytes: int) -> int:
    """Adam's bytes a parameter: two fp32 moments, and under 16-bit weights an fp32 master copy (ADAM_BYTES)."""
    return ADAM_BYTES if weight_bytes < 4 else 8


def trainer_states(model: ModelShape, gpus: int, zero_stage: int) -> float:
    """The states of a full fine-tune with Adam under mixed precision on each of its `gpus` GPUs (trainer_parts)."""
    return sum(trainer_parts(model, gpus, zero_stage).values())


def held_activation_bytes(model: ModelShape, tokens: float) -> float:
    """What gradient checkpointing keeps of a micro-batch of `tokens` through backward: each layer's BF16 input."""
    return tokens * model.layers * model.width * BF16


def layer_activation_bytes(model: ModelShape) -> float:
    """Bytes a token's pass through one decoder layer keeps for backward in BF16, counted tensor by tensor as
    Korthikanti et al. count a GPT layer's (arXiv 2205.05198 section 4.1), for a Qwen2/Llama layer under SDPA:
    both norms' inputs and outputs, q, k and v (k and v at every head, as transformers repeats them for SDPA) and
    the attention's output (its fused kernel keeps no sequence x sequence scores): 8 x width; SwiGLU's gate, up,
    SiLU(gate) and product: 4 x intermediate."""
    return (8 * model.width + 4 * model.ffn) * BF16


def activation_bytes(model: ModelShape, tokens: float, checkpointing: bool) -> float:
    """A micro-batch of `tokens` at its peak in backward: every layer's activations, or under gradient
    checkpointing each layer's input and the one layer being recomputed."""
    if checkpointing:
        return held_activation_bytes(model, tokens) + tokens * layer_activation_bytes(model)
    return tokens * model.layers * layer_activation_bytes(model)


def head_bytes(model: ModelShape, chunk_tokens: float) -> float:
    """The output head's backward, `chunk_tokens` tokens at a time (rlsys/trainer/logprobs.py ChunkedHeadLogprobs):
    each chunk's BF16 logits, three fp32 copies (scaled, softmax, gradient) and its BF16 gradient, 16 bytes a
    logit; and the head's gradient summed over the chunks in fp32."""
    return chunk_tokens * model.vocab * 16 + model.vocab * model.width * 4


def step_gradient_bytes(model: ModelShape, gpus: int, zero_stage: int) -> float:
    """DeepSpeed's bf16 optimizer step casts this GPU's gradient partition to fp32 first (runtime/zero/
    stage_1_and_2.py `step`): 4 bytes a parameter of the partition, until the step ends."""
    return model.params * 4 / (gpus if zero_stage >= 1 else 1)


def zero_buffer_bytes(model: ModelShape, zero_stage: int, weight_bytes: int = TRAIN_WEIGHT_BYTES) -> float:
    """DeepSpeed's working buffer at its defaults: ZeRO-3's gathered parameters, else the gradient reduce bucket."""
    return min(model.params, ZERO3_LIVE_PARAMS if zero_stage == 3 else REDUCE_BUCKET_ELEMENTS) * weight_bytes


def trainer_bytes(model: ModelShape, gpus: int, zero_stage: int) -> float:
    """What the trainer holds on each of its GPUs while it trains, as the emulated clock and the simulator count
    it: its states and the checkpointed activations of ACTIVATION_TOKENS tokens (each layer's BF16 input)."""
    return trainer_states(model, gpus, zero_stage) + held_activation_bytes(model, ACTIVATION_TOKENS)


def trainer_room(model: ModelShape, gpu: GPU, gpus: int, zero_stage: int,
                 memory_fraction: float = MEMORY_FRACTION) -> float:
    """Bytes left on each of the trainer's GPUs once it holds `trainer_bytes` (of the same usable share of memory
    as an engine's); below 0 the trainer does not fit."""
    return memory_fraction * gpu.memory - trainer_bytes(model, gpus, zero_stage)


def switch_seconds(gpu: GPU, leaving: float, arriving: float) -> float:
    """One switch of a GPU the engine and the trainer share, from one to the other: the side leaving copies its
    `leaving` bytes there to host memory (`engine_bytes`, or `trainer_states`: no activations outlive a switch),
    then the side arriving copies its `arriving` back, over the GPU's host link. Inference to training: vLLM's
    sleep at level 1 (weights to host memory, the KV cache discarded: no copy), then the trainer's states loaded;
    training to inference: the trainer's states offloaded (OpenRLHF's DeepSpeed sleep), then the engine's
    wake-up (its weights back, its KV cache allocated again)."""
    return (leaving + arriving) / (gpu.host_bandwidth * HOST_LINK_EFFICIENCY)
