"""The built-in engine: a Qwen2/Llama decoder with a static slot KV cache and continuous batching, on the CPU
or a CUDA GPU (`rollout.device`; the class keeps its first name, CPUEngine, and the registry its `cpu`).

Written from scratch: transformers' generate runs a fixed batch to its longest member and costs about
3x more CPU per token on the tiny model (benchmarks/engine_throughput.py). Here one decode step runs
every active slot in one batched forward, slots of one power-of-two length bucket attending together to
their own keys only, and a waiting request takes a slot the moment one frees up; on CUDA the decode step
runs at static shapes as CUDA graphs instead (graph_step.py). A step reads back from the device once (see
CPUEngine). Weights come from the model directory's Hugging Face safetensors and can be swapped between
steps (`load_weights`, or `receive_weights` bucket by bucket), tagging later tokens with a new version.
"""
from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from rlsys.emulate import EnginePacer, Interrupt
from rlsys.rollout.attention import DECODE_ATTENTION, default_attention
from rlsys.rollout.graph_step import DecodeGraphs
from rlsys.rollout.shapes import BATCH_FINE, KEYS_FINE, bucket, buckets
from rlsys.rollout.engine import (EngineCounters, RolloutEngine, check_request, read_eos_ids, read_tokenizer,
                                  token_budget)
from rlsys.types import Completion, Request
from rlsys.weights import WeightGroup, WeightUpdate


def _read_config(model_dir: Path):
    from transformers import AutoConfig

    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    cfg = AutoConfig.from_pretrained(str(model_dir))
    where = f"{model_dir / 'config.json'}"
    if cfg.model_type not in ("qwen2", "llama"):
        raise ValueError(f"{where}: model_type {cfg.model_type!r} is not supported by the built-in engine "
                         "(qwen2 or llama)")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported by the built-in engine")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{where}: mlp_bias=true is not supported by the built-in engine")
    if cfg.hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported (silu only)")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope type {rope['rope_type']!r} is not supported (default RoPE only)")
    return cfg


def _load_safetensors(model_dir: Path) -> dict[str, Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (save with save_pretrained)")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


CPU = torch.device("cpu")
# Padded tokens per prefill forward, as vLLM's max_num_batched_tokens: admitting 256 prompts of 4096 tokens in
# one forward ran out of memory on an H100 (one gate/up activation of a 0.5B model: 22 GiB in bf16).
PREFILL_TOKENS = 16384
# How a decode step runs (CPUEngine's `decode`): "eager" batches only the decoding slots, in length spans;
# "static" runs the static-shape step of graph_step.py as plain torch (the CPU's way to test it); "graph"
# replays it as CUDA graphs (the default on CUDA).
DECODE_MODES = ("eager", "static", "graph")


class _CudnnAttentionOff:
    """cuDNN's attention off while any engine of this process runs a forward: it builds an execution graph on the
    host for each new shape (2.8 ms a call on an H100, 90 ms a decode step at 0.5B against 9 ms), and a decode
    step's key length is new every step. The flag is the process's, not a thread's: engines stepping at once
    (a process's local workers) share one switch, set by the first in and restored by the last out (torch's
    sdpa_kernel, per forward, let the first out turn cuDNN back on under the others, and the last leave it off)."""

    def __init__(self):
        self.lock, self.inside, self.was_on = threading.Lock(), 0, True

    def __enter__(self) -> None:
        with self.lock:
            if not self.inside:
                self.was_on = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self.inside += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.inside -= 1
            if not self.inside:
                torch.backends.cuda.enable_cudnn_sdp(self.was_on)


CUDNN_ATTENTION_OFF = _CudnnAttentionOff()


@dataclass(frozen=True)
class Span:
    """Rows [start, stop) of a decode batch, whose slots lie in [lo, hi), attending to the first kv_len cache
    positions. The cache rows lo..hi are read as a view, never gathered: slots in between that are not the
    span's (another length bucket's, or free) get a dummy query whose output is dropped."""
    start: int
    stop: int
    kv_len: int
    lo: int
    hi: int
    consecutive: bool  # the span's slots are exactly lo..hi-1, in order: no scatter of queries


def length_bucket(length: int) -> int:
    """k for a length in (2**(k-1), 2**k]."""
    return (length - 1).bit_length()


def length_spans(lengths: list[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of a batch ordered by length bucket, one per bucket: attending to its longest member
    costs each sequence less than twice its own length, in at most log2(max_len) + 1 attention calls."""
    cuts = [i for i in range(1, len(lengths)) if length_bucket(lengths[i]) != length_bucket(lengths[i - 1])]
    bounds = [0, *cuts, len(lengths)]
    return list(zip(bounds, bounds[1:]))


def prefill_chunks(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """[start, stop) runs of a batch, in order, each padded to its longest within `budget` tokens (a longer
    sequence alone)."""
    chunks, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, n) > budget:
            chunks.append((start, i))
            start, longest = i, 0
        longest = max(longest, n)
    return chunks + [(start, len(lengths))] if lengths else chunks


def _span(slots: list[int], start: int, stop: int, kv_len: int) -> Span:
    mine = slots[start:stop]
    lo, hi = min(mine), max(mine) + 1
    return Span(start, stop, kv_len, lo, hi, mine == list(range(lo, hi)))


class DecoderModel:
    """The weights (q/k/v and gate/up fused for fewer matmuls) and a forward over the slot KV cache."""

    def __init__(self, model_dir: Path, slots: int, max_len: int | None, dtype: torch.dtype,
                 device: torch.device = CPU, attention: str = "sdpa"):
        cfg = _read_config(model_dir)
        self.attend = DECODE_ATTENTION[attention]  # a decode span's attention (attention.py)
        self.vocab, self.hidden = cfg.vocab_size, cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.layers, self.eps = cfg.num_hidden_layers, cfg.rms_norm_eps
        # The KV cache holds max_len positions per slot: callers pass what a run can use (prompt + response),
        # as a real model's context (8k for SmolLM2) would cost gigabytes per few slots.
        self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.config = cfg
        H, KV, D, I = self.heads, self.kv_heads, self.head_dim, cfg.intermediate_size
        qkv_bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        o_bias = cfg.model_type == "llama" and getattr(cfg, "attention_bias", False)

        def empty(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.embed = empty(self.vocab, self.hidden)
        self.norm = empty(self.hidden)
        self.lm_head = self.embed if cfg.tie_word_embeddings else empty(self.vocab, self.hidden)
        self.params: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed,
                                          "model.norm.weight": self.norm, "lm_head.weight": self.lm_head}
        self.blocks = []
        for i in range(self.layers):
            b = dict(wqkv=empty((H + 2 * KV) * D, self.hidden), bqkv=empty((H + 2 * KV) * D) if qkv_bias else None,
                     wo=empty(self.hidden, H * D), bo=empty(self.hidden) if o_bias else None,
                     wgu=empty(2 * I, self.hidden), wdown=empty(self.hidden, I),
                     ln_in=empty(self.hidden), ln_post=empty(self.hidden))
            self.blocks.append(b)
            p = f"model.layers.{i}."
            cuts = {"q": (0, H * D), "k": (H * D, (H + KV) * D), "v": ((H + KV) * D, (H + 2 * KV) * D)}
            for name, (a, z) in cuts.items():
                self.params[p + f"self_attn.{name}_proj.weight"] = b["wqkv"][a:z]
                if qkv_bias:
                    self.params[p + f"self_attn.{name}_proj.bias"] = b["bqkv"][a:z]
            self.params[p + "self_attn.o_proj.weight"] = b["wo"]
            if o_bias:
                self.params[p + "self_attn.o_proj.bias"] = b["bo"]
            self.params[p + "mlp.gate_proj.weight"] = b["wgu"][:I]
            self.params[p + "mlp.up_proj.weight"] = b["wgu"][I:]
            self.params[p + "mlp.down_proj.weight"] = b["wdown"]
            self.params[p + "input_layernorm.weight"] = b["ln_in"]
            self.params[p + "post_attention_layernorm.weight"] = b["ln_post"]
        self.load_state_dict(_load_safetensors(model_dir), strict=True, source=str(model_dir))

        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        # one position more than max_len: the scratch column a static decode step's idle rows write to
        self.scratch = self.max_len
        freqs = torch.outer(torch.arange(self.max_len + 1, dtype=torch.float32), inv_freq)
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(device, dtype)
        # rotate_half(x) * sin == roll(x, D/2) * sin with the first half negated: one op fewer per step
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device, dtype)
        self.kv_shape = (self.layers, slots, KV, self.max_len + 1, D)
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        """A zeroed KV cache, beside the weights (again after free_kv_cache), and its additive mask: 0 at each
        slot's written positions, -inf elsewhere, kept up to date as positions are written (no mask is built
        per step)."""
        self.k_cache = torch.zeros(self.kv_shape, dtype=self.embed.dtype, device=self.embed.device)
        self.v_cache = torch.zeros(self.kv_shape, dtype=self.embed.dtype, device=self.embed.device)
        self.kv_mask = torch.full(self.kv_shape[1:4:2], float("-inf"), dtype=self.embed.dtype, device=self.embed.device)

    def free_kv_cache(self) -> None:
        self.k_cache = self.v_cache = self.kv_mask = None

    def load_state_dict(self, state: dict[str, Tensor], strict: bool, source: str = "state_dict") -> None:
        unknown = sorted(set(state) - set(self.params))
        if unknown:
            raise KeyError(f"{source}: unknown parameter names {unknown[:5]} (expected Hugging Face names "
                           f"of a {self.config.model_type} model)")
        missing = set(self.params) - set(state) - ({"lm_head.weight"} if self.lm_head is self.embed else set())
        if strict and missing:
            raise KeyError(f"{source}: missing parameters {sorted(missing)[:5]}")
        for name, value in state.items():
            target = self.params[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{source}: {name} has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target.copy_(value)

    def forward(self, ids: Tensor, pos: Tensor, slots: Tensor, spans: list[Span] | None = None,
                last: Tensor | None = None, offset: int = 0) -> Tensor:
        """ids, pos: [N, T] tokens and their positions, written to cache rows `slots` [N].
        A prefill (spans None, `last` [N] each row's last real token): every row starts at position 0 and
        attends causally to its own new keys; its padding after `last` is never unmasked in the cache.
        A decode step (T = 1): each span of the batch attends to its own first kv_len cache positions, so a
        short sequence never pays for a long one. A conversation's continuation (one row, `offset` > 0: its slot's
        cache holds positions 0..offset-1) is a prefill that also attends to those keys. Returns logits at
        `last` of T (T must be 1 without it)."""
        N, T = ids.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        NT = N * T
        flat_pos, flat_slots = pos.reshape(NT), slots[:, None].expand(N, T).reshape(NT)
        cos, sin = self.cos[flat_pos, None], self.signed_sin[flat_pos, None]  # [NT, 1, D]
        scatter = None
        zero = torch.zeros((), dtype=self.kv_mask.dtype, device=ids.device)  # a Python 0.0 would be a host copy: a sync
        if spans is None:  # a slot's earlier occupant may have written further: its row starts anew
            written = torch.arange(self.max_len + 1, device=ids.device) <= (pos[:, 0] + last)[:, None]
            self.kv_mask[slots] = zero.masked_fill(~written, float("-inf"))
        else:
            self.kv_mask[flat_slots, flat_pos] = zero
            scatter = self._scatter_plan(slots, spans)
        x = F.embedding(ids.reshape(NT), self.embed)  # 2-D activations: faster matmuls on CPU than [N, T, d]
        with CUDNN_ATTENTION_OFF:
            for layer, b in enumerate(self.blocks):
                h = F.rms_norm(x, (self.hidden,), b["ln_in"], self.eps)
                qkv = F.linear(h, b["wqkv"], b["bqkv"])
                qk = qkv[:, : (H + KV) * D].view(NT, H + KV, D)
                qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # RoPE on q and k at once
                k, v = qk[:, H:], qkv[:, (H + KV) * D:].view(NT, KV, D)
                k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
                k_cache[flat_slots, :, flat_pos] = k
                v_cache[flat_slots, :, flat_pos] = v
                if offset:
                    o = self._attend_continuation(qk[:, :H], layer, slots, offset, T)
                elif spans is None:
                    o = self._attend_prefill(qk[:, :H], k, v, N, T)
                else:
                    o = self._attend_decode(qk[:, :H].view(N, KV, H // KV, D), layer, spans, scatter)
                x = torch.addmm(x, o, b["wo"].t())  # the residual add rides along with the matmul
                if b["bo"] is not None:
                    x += b["bo"]
                h = F.rms_norm(x, (self.hidden,), b["ln_post"], self.eps)
                gate, up = F.linear(h, b["wgu"]).chunk(2, dim=-1)
                x = torch.addmm(x, F.silu(gate) * up, b["wdown"].t())
        if last is not None:
            x = x.view(N, T, self.hidden)[torch.arange(N, device=x.device), last]
        return F.linear(F.rms_norm(x, (self.hidden,), self.norm, self.eps), self.lm_head).float()

    def _attend_prefill(self, q: Tensor, k: Tensor, v: Tensor, N: int, T: int) -> Tensor:
        """Causal attention of [N*T, heads, D] over the batch's own new keys (positions 0..T-1: no cache read,
        no mask tensor); kv groups shared by enable_gqa, not copied."""
        def heads_first(t: Tensor) -> Tensor:
            return t.view(N, T, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(N * T, -1)

    def _attend_continuation(self, q: Tensor, layer: int, slots: Tensor, offset: int, T: int) -> Tensor:
        """Causal attention of one row's T new queries [T, heads, D] at positions offset.. over its slot's cache,
        its earlier turns' keys included (just written with the new ones)."""
        keys = self.k_cache[layer, slots, :, :offset + T]  # [1, KV, offset + T, D]
        values = self.v_cache[layer, slots, :, :offset + T]
        causal = torch.ones(T, offset + T, dtype=torch.bool, device=q.device).tril(offset)
        o = F.scaled_dot_product_attention(q.view(1, T, -1, self.head_dim).transpose(1, 2), keys, values,
                                           attn_mask=causal, enable_gqa=True)
        return o.transpose(1, 2).reshape(T, -1)

    def _scatter_plan(self, slots: Tensor, spans: list[Span]) -> list[tuple[Tensor, Tensor] | None]:
        """For each span whose slots are not exactly lo..hi-1: its rows' places in lo..hi and a zeroed query buffer
        of that height, made once a step (not once a layer: on a GPU each op is a launch the host pays for); every
        layer writes its queries into the same places, the other rows stay zero."""
        shape = (self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        dtype = self.embed.dtype
        return [None if s.consecutive else (slots[s.start:s.stop] - s.lo,
                                            torch.zeros((s.hi - s.lo, *shape), dtype=dtype, device=slots.device))
                for s in spans]

    def _attend_decode(self, q: Tensor, layer: int, spans: list[Span], scatter: list) -> Tensor:
        """One new token per row, q [N, KV, G, D] (a kv group's query heads share its keys, as the query
        length): each span over its cache rows lo..hi as a view and its kv_len positions. Returns [N, H*D]."""
        parts = []
        for s, placed in zip(spans, scatter):
            rows, q_span = slice(s.lo, s.hi), q[s.start:s.stop]
            if placed is not None:  # the queries at their slots' rows (_scatter_plan); the others' outputs dropped
                local, buffer = placed
                q_span = buffer.index_copy_(0, local, q_span)
            o = self.attend(q_span, self.k_cache[layer, rows, :, :s.kv_len], self.v_cache[layer, rows, :, :s.kv_len],
                            self.kv_mask[rows, None, None, :s.kv_len])
            parts.append(o if placed is None else o.index_select(0, local))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        return o.reshape(o.shape[0], -1)


@dataclass
class _Running:
    request: Request
    submit_time: float
    start_time: float = 0.0
    slot: int = -1
    sampled: int = 0  # tokens sampled so far, resumed ones included; the last may still be on the device
    tokens: list[int] = field(default_factory=list)  # those the host has, with their log-probs and versions
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_version: int = 0  # the oldest weights that wrote the request's KV cache
    stale_kv_tokens: int = 0  # tokens sampled over KV written by older weights (weights.running_requests=keep)
    mask: list[int] = field(default_factory=list)  # a conversation's: 1 per model token, 0 per tool token
    turns: list = field(default_factory=list)  # its ToolTurns
    held: bool = False  # waiting on a tool: no step decodes it; it keeps its slot and KV cache
    continue_at: int | None = None  # a tool answered: the next step prefills tokens[continue_at - 1:]


class CPUEngine(RolloutEngine):
    """The built-in engine, on the CPU or a CUDA device. What the host decides on (slots, lengths, budgets,
    sampling parameters) it keeps itself, so a step reads back from the device only its new tokens, in
    one transfer (`_fetch`): one sync per step on a GPU. `decode`: DECODE_MODES, by default "graph" on
    CUDA and "eager" on the CPU (where launches cost nothing and the static step's padding would); `attention`:
    the decode attention (attention.py), by default split_kv on CUDA and sdpa on the CPU."""

    def __init__(self, model_dir: str, slots: int, eos_token_id: int | None = None,
                 max_len: int | None = None, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", name: str = "cpu engine", seed: int = 0,
                 running_requests: str = "recompute", pacer: EnginePacer | None = None, decode: str | None = None,
                 attention: str | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (got {slots})")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"rollout.device=cuda: {name} sees no CUDA device (torch.cuda.is_available() is "
                             "false); use rollout.device=cpu, or run where the worker gets a GPU")
        self.decode = decode or ("graph" if self.device.type == "cuda" else "eager")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}: one of {', '.join(DECODE_MODES)}")
        if self.decode == "graph" and not torch.cuda.is_available():
            raise ValueError(f"decode=graph: {name} captures CUDA graphs and sees no CUDA device")
        self.attention = attention or default_attention(self.device)
        if self.attention not in DECODE_ATTENTION:
            raise ValueError(f"attention={attention!r}: one of {', '.join(DECODE_ATTENTION)}")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        path = Path(model_dir)
        with torch.inference_mode():
            self.model = DecoderModel(path, slots, max_len, dtype, self.device, self.attention)
        self.name, self.slots, self.max_len, self.version = name, slots, self.model.max_len, 0
        self.seed = seed  # the run's: a request without a seed draws from (seed, request id), whatever engine runs it
        self.weight_group: WeightGroup | None = None  # joined for a transport that needs one (broadcast)
        self.running_requests = running_requests  # weights.running_requests: "recompute" or "keep"
        self.eos_ids = read_eos_ids(path, eos_token_id)
        self.tokenizer = read_tokenizer(path)
        self.waiting: dict[str, _Running] = {}  # insertion order = arrival order
        self.running: dict[str, _Running] = {}
        self.slot_owner: list[_Running | None] = [None] * slots
        self.finished_early: list[Completion] = []  # resumed requests that had nothing left to do
        # Per-slot sampling state on the device, so one step samples every slot without a Python loop.
        S, L, dev = slots, self.max_len, self.device
        self.last_token = torch.zeros(S, dtype=torch.long, device=dev)  # sampled, not yet in the cache
        self.temperature = torch.zeros(S, device=dev)
        self.top_p = torch.ones(S, device=dev)
        self.claimed_temperature = torch.zeros(S, device=dev)  # SamplingParams.logprob_temperature
        self.claims = torch.zeros(S, dtype=torch.bool, device=dev)  # a sampled slot that records a claimed one
        self.uniforms = torch.zeros(S, L, device=dev)  # pre-drawn per request from its own seeded generator
        # The static decode step's inputs (positions, uniform indices, the slot of each output row) and outputs,
        # at fixed addresses for the graphs; the inputs come from pinned memory in one copy a step.
        self.step_inputs = torch.zeros(3, S, dtype=torch.long, device=dev)
        self.step_inputs_host = torch.zeros(3, S, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.step_tokens = torch.zeros(S, dtype=torch.long, device=dev)
        self.step_logprobs = torch.zeros(S, device=dev)
        self.rows = torch.arange(S, device=dev)
        self.batch_sizes, self.key_lengths = buckets(S, BATCH_FINE), buckets(L, KEYS_FINE)
        self.graphs = DecodeGraphs()
        self.counters = EngineCounters()
        self.pacer = pacer  # emulate: each step held until its modelled time on the emulated GPU
        self._interrupt = Interrupt(self._land)  # emulate: aborts land inside a held step (interrupt_step)
        self._pacing: list[_Running] = []  # what the held step decodes on the run's clock
        self._prefilled_on_clock = 0  # this step's prefilled tokens of requests on the run's clock, for the pacer
        self._prompts_on_clock = [0, 0]  # ...of which prompts: how many, and their tokens

    # --- interface --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request {request.request_id}: request_id already in the engine")
        self.validate(request)
        entry = _Running(request, time.time(), sampled=len(request.resume_ids), tokens=list(request.resume_ids),
                         logprobs=list(request.resume_logprobs), versions=list(request.resume_versions),
                         **self._conversation_so_far(request))
        reason = self._resume_reason(entry)
        if reason:
            self.finished_early.append(self._completion(entry, reason))
        else:  # one cut while its tool ran (held) has made its call again and waits for the answer
            self.waiting[request.request_id] = entry

    def _call_or_end(self, entry: _Running) -> str | None:
        reason = super()._call_or_end(entry)
        if entry.held:
            entry.sampled = len(entry.tokens)  # a token decoded past the call in the same step is dropped
        return reason

    def extend(self, request_id: str, at: int, ids: list[int], turn) -> None:
        entry = self._waiting_on(request_id, at)
        if entry is None:
            return
        spent = self._append_answer(entry, ids, turn)
        entry.sampled = len(entry.tokens)
        if spent:
            self.finished_early.append(self._finish(entry.slot, "length") if entry.slot >= 0
                                       else self._completion(self.waiting.pop(request_id), "length"))
        elif entry.slot >= 0:
            entry.continue_at = at

    def _records(self):
        # a queued request starts only in a free slot: with every slot taken (by conversations waiting on tools,
        # say), a step cannot advance it, and counting it would spin the worker
        return (*(self.waiting.values() if None in self.slot_owner else ()), *self.running.values())

    def _record_of(self, request_id: str):
        return self.running.get(request_id) or self.waiting.get(request_id)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        t0 = time.perf_counter()
        done, self.finished_early = self.finished_early, []
        self._prefilled_on_clock, self._prompts_on_clock = 0, [0, 0]
        admitted, continued = self._admit(), self._continue()
        prefilled = [e for batch in (admitted, continued) if batch for e in batch[0]]
        # An admitted request decodes in the same step unless its budget is spent. Whether its prefill token
        # was an EOS or ended a tool call is known only after the fetch: then the decoded token is dropped.
        # Not when emulating: the token a prefill samples stands for k emulated tokens, of which a prefill makes
        # only the first; the other k - 1 are this step's paced decode steps, as the simulator charges them.
        fresh = {id(e) for e in (prefilled if self.pacer else continued[0] if continued else [])}
        decoding = [e for e in self.running.values()
                    if not e.held and id(e) not in fresh and not self._spent(e, e.sampled)]
        batches = [b for b in (admitted, continued, self._decode_batch(decoding)) if b]
        new_tokens = 0
        if batches:
            entries = [e for b in batches for e in b[0]]
            tokens, logprobs = self._fetch(torch.cat([b[1] for b in batches]), torch.cat([b[2] for b in batches]))
            if self.pacer:  # its tokens exist once its time has passed; one aborted meanwhile keeps none of them
                self._pace(t0, decoding + prefilled)
            for e, token, logprob in zip(entries, tokens, logprobs):
                if self.slot_owner[e.slot] is e and not e.held:
                    new_tokens += 1
                    self._record(e, token, logprob, done)
        generating = len(decoding) + sum(id(e) in fresh for e in prefilled)  # slots this step kept busy
        self.counters.record(generating, self.slots, new_tokens, time.perf_counter() - t0)
        return done

    def _pace(self, t0: float, decoding: list[_Running]) -> None:
        """emulate: hold the step until the modelled time of its prefill and of its decoding over the KV cache it
        read (each decoding entry's keys before this step's token; a prefilled entry decodes the rest of its
        prefill token's k). Requests off the run's clock (eval's) cost nothing modelled: a step of only those
        runs at the machine's speed."""
        decoding_on = [e for e in decoding if e.request.on_clock]
        if not self._prefilled_on_clock and not decoding_on:
            return
        prompt_kv = sum(len(e.request.prompt_ids) for e in decoding_on)
        read_kv = prompt_kv + sum(e.sampled - 1 for e in decoding_on)
        prompts, prompt_prefill = self._prompts_on_clock
        self._pacing = decoding_on
        try:
            self.pacer.step(t0, self._prefilled_on_clock, len(decoding_on), read_kv, interrupt=self._interrupt,
                            prompts=prompts, prompt_prefill=prompt_prefill, prompt_kv=prompt_kv)
        finally:
            self._pacing = []

    def interrupt_step(self) -> None:
        if self.pacer:
            self._interrupt.wake()

    def _land(self) -> bool:
        """Inside a held step, one emulated decode step after a wake: the aborts waiting (`between_decode_steps`)
        applied now, their requests out of the step with the tokens they had before it; whether any of its
        requests on the run's clock is left to hold for. (The rest hold to the step's end, its time unchanged.)"""
        if self.between_decode_steps:
            self.between_decode_steps()
        return any(self.slot_owner[e.slot] is e for e in self._pacing)

    def stats(self) -> dict:
        out = super().stats()
        if self.pacer:
            out["emulate"] = self.pacer.counts()
        return out

    def abort(self, request_ids: list[str]) -> list[Completion]:
        out = []
        for rid in request_ids:
            if rid in self.waiting:
                out.append(self._completion(self.waiting.pop(rid), "abort"))
            elif rid in self.running:
                out.append(self._finish(self.running[rid].slot, "abort"))
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.finished_early)

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "slots": self.slots}

    @torch.inference_mode()
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        self.refuse_older(version)
        self.model.load_state_dict(state_dict, strict=False, source=f"weights version {version}")
        self._weights_changed(version)

    def init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str = "gloo",
                          timeout_s: float = 600.0) -> None:
        self.weight_group = WeightGroup(host, port, rank_offset, world_size, backend, timeout_s)

    @torch.inference_mode()
    def receive_weights(self, update: WeightUpdate) -> None:
        # Each bucket is a partial state dict (loaded with strict=False); the version changes after the last.
        self.refuse_older(update.version)
        source = f"{self.name}: weights version {update.version}"
        for weights in update.buckets(self.name, self.device, self.weight_group):
            self.model.load_state_dict(dict(weights), strict=False, source=source)
        self._weights_changed(update.version)

    def _weights_changed(self, version: int) -> None:
        """weights.running_requests: recompute the running requests' KV cache under the new weights, or keep
        it (their later tokens are counted in Completion.stale_kv_tokens)."""
        self.version = version
        if self.running_requests == "recompute" and self.running:
            self._prefill_running()

    def _prefill_running(self) -> None:
        """Write every running slot's cache again from its tokens: the prompt, and all sampled but the last
        (which the next step feeds), in one batched forward."""
        entries = sorted(self.running.values(), key=lambda e: e.slot)
        self._prefill(entries, [e.request.prompt_ids + e.tokens[:-1] for e in entries])
        for e in entries:
            e.kv_version = self.version

    def _release(self, level: int) -> None:
        """Sleep frees the KV cache; the weights stay, as host memory is where a level-1 sleep would keep them
        and level 2's caller loads new ones anyway."""
        self.model.free_kv_cache()
        self.graphs.clear()  # they read the freed cache; each shape is captured again after the wake
        if self.device.type == "cuda":  # give the freed blocks back to the trainer on this GPU
            torch.cuda.empty_cache()

    def _reclaim(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            self.model.allocate_kv_cache()

    # --- generation -------------------------------------------------------------------------
    def _admit(self) -> tuple | None:
        """Move waiting requests into free slots with one batched prefill: (entries, tokens, log-probs)."""
        free = [slot for slot, owner in enumerate(self.slot_owner) if owner is None]
        ready = [rid for rid, e in self.waiting.items() if not e.held][:len(free)]  # not those waiting on a tool
        entries = [self.waiting.pop(rid) for rid in ready]
        if not entries:
            return None
        now = time.time()
        for e, slot in zip(entries, free):
            self._occupy(e, slot, now)
        seqs = [e.request.prompt_ids + e.tokens for e in entries]
        self._count_prefill(entries, seqs)
        on_clock = [e for e in entries if e.request.on_clock]
        self._prompts_on_clock = [len(on_clock), sum(len(e.request.prompt_ids) for e in on_clock)]
        plan, logits = self._prefill(entries, seqs)
        return self._sample_into(entries, plan, logits)

    def _continue(self) -> tuple | None:
        """Conversations whose tool answered: prefill only the call's last token (not yet in the cache) and the
        answer, over the KV cache the conversation kept, and sample the model's next token."""
        entries = [e for e in self.running.values() if e.continue_at is not None]
        if not entries:
            return None
        seqs = [e.tokens[e.continue_at - 1:] for e in entries]
        self._count_prefill(entries, seqs)
        logits = []
        for e, seq in zip(entries, seqs):
            start = len(e.request.prompt_ids) + e.continue_at - 1
            ids, pos = self._to_device(torch.tensor([seq])), torch.arange(start, start + len(seq), device=self.device)
            logits.append(self.model.forward(ids, pos[None], self._to_device(torch.tensor([e.slot])),
                                             last=self._to_device(torch.tensor([len(seq) - 1])), offset=start))
            e.continue_at = None
        plan = self._plan(entries, [len(e.request.prompt_ids) + len(e.tokens) - 1 for e in entries])
        return self._sample_into(entries, plan, torch.cat(logits))

    def _count_prefill(self, entries: list[_Running], seqs: list[list[int]]) -> None:
        self.counters.prefilled_tokens += sum(map(len, seqs))
        self._prefilled_on_clock += sum(len(s) for e, s in zip(entries, seqs) if e.request.on_clock)

    def _prefill(self, entries: list[_Running], seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Write each entry's tokens `seqs` into its slot's cache in batched forwards of at most PREFILL_TOKENS
        padded tokens: (the plan, see _plan; the logits at each sequence's last token)."""
        plans, logits = [], []
        for a, z in prefill_chunks([len(s) for s in seqs], PREFILL_TOKENS):
            T = max(len(s) for s in seqs[a:z])
            ids = self._to_device(torch.tensor([s + [0] * (T - len(s)) for s in seqs[a:z]]))
            plan = self._plan(entries[a:z], [len(s) - 1 for s in seqs[a:z]])
            pos = torch.arange(T, device=self.device).expand(z - a, -1)
            plans.append(plan)
            logits.append(self.model.forward(ids, pos, plan[0], last=plan[1]))
        return (plans[0], logits[0]) if len(plans) == 1 else (torch.cat(plans, 1), torch.cat(logits))

    def _decode_batch(self, entries: list[_Running]) -> tuple | None:
        """One token for each entry in one batched forward; entries of a length bucket attend together."""
        if not entries:
            return None
        if self.decode != "eager":
            return self._decode_static(entries)
        key_count = {id(e): len(e.request.prompt_ids) + e.sampled for e in entries}  # its new token's included
        entries = sorted(entries, key=lambda e: (length_bucket(key_count[id(e)]), e.slot))
        lengths, slots = [key_count[id(e)] for e in entries], [e.slot for e in entries]
        plan = self._plan(entries, [n - 1 for n in lengths])
        spans = [_span(slots, a, z, max(lengths[a:z])) for a, z in length_spans(lengths)]
        logits = self.model.forward(self.last_token[plan[0], None], plan[1, :, None], plan[0], spans)
        return self._sample_into(entries, plan, logits)

    def _decode_static(self, entries: list[_Running]) -> tuple:
        """_decode_batch at static shapes (graph_step.py): slots 0..B-1 over K keys, B and K the buckets of
        the highest decoding slot and the longest key count; one copy of the inputs, one graph or step."""
        entries = sorted(entries, key=lambda e: e.slot)
        B = bucket(entries[-1].slot + 1, self.batch_sizes)
        K = bucket(max(len(e.request.prompt_ids) + e.sampled for e in entries), self.key_lengths)
        positions, index, order = [self.model.scratch] * B, [0] * B, [0] * B
        for row, e in enumerate(entries):
            positions[e.slot], index[e.slot], order[row] = len(e.request.prompt_ids) + e.sampled - 1, e.sampled, e.slot
        self.step_inputs_host[:, :B] = torch.tensor([positions, index, order])
        self.step_inputs[:, :B].copy_(self.step_inputs_host[:, :B], non_blocking=True)
        shape = (B, K, self._sampling_mode([e.request.params for e in entries]))
        step = lambda: self._static_step(*shape)  # noqa: E731
        if self.decode == "graph":
            self.graphs.run(shape, step, self.model.k_cache)
        else:
            step()
        n = len(entries)
        tokens, logprobs = self.step_tokens[:n], self.step_logprobs[:n]
        self.last_token.index_copy_(0, self.step_inputs[2, :n], tokens)
        for e in entries:
            e.sampled += 1
        return entries, tokens, logprobs

    def _static_step(self, B: int, K: int, mode: tuple[bool, bool, bool]) -> None:
        """The decode step of slots 0..B-1 over K cache positions, every shape fixed by (B, K, mode) and every
        input read from the persistent buffers: each slot's token from last_token, its position (the scratch
        column for a slot not decoding) and uniform index from step_inputs. Writes the tokens and log-probs of
        the decoding slots, in slot order, to step_tokens and step_logprobs; changes nothing it reads."""
        positions, index, order = self.step_inputs[:, :B]
        rows = self.rows[:B]
        logits = self.model.forward(self.last_token[:B, None], positions[:, None], rows, [Span(0, B, K, 0, B, True)])
        tokens, logprobs = self._sample(rows, index, logits, mode)
        self.step_tokens[:B] = tokens.index_select(0, order)
        self.step_logprobs[:B] = logprobs.index_select(0, order)

    def _plan(self, entries: list[_Running], positions: list[int]) -> Tensor:
        """Slots, input positions and the index of the token to sample, in one host-to-device copy."""
        return self._to_device(torch.tensor([[e.slot for e in entries], positions, [e.sampled for e in entries]]))

    def _to_device(self, t: Tensor) -> Tensor:
        return t.to(self.device, non_blocking=True)  # from the host: no wait on the device

    def _sample_into(self, entries: list[_Running], plan: Tensor, logits: Tensor) -> tuple:
        mode = self._sampling_mode([e.request.params for e in entries])
        tokens, logprobs = self._sample(plan[0], plan[2], logits, mode)
        self.last_token[plan[0]] = tokens
        for e in entries:
            e.sampled += 1
        return entries, tokens, logprobs

    def _fetch(self, tokens: Tensor, logprobs: Tensor) -> tuple[list[int], list[float]]:
        """A step's one read from the device: its new tokens and their log-probs in one transfer (on a GPU,
        the step's only sync)."""
        packed = torch.stack([tokens.double(), logprobs.double()]).tolist()  # token ids < 2**53: exact
        return [int(t) for t in packed[0]], packed[1]

    def _record(self, entry: _Running, token: int, logprob: float, done: list[Completion]) -> None:
        entry.tokens.append(token)
        entry.logprobs.append(logprob)
        entry.versions.append(self.version)
        entry.mask.append(1)
        entry.stale_kv_tokens += entry.kv_version < self.version
        if token in self.eos_ids:  # the turn's end: of the conversation, or of a turn of several calls
            reason = self._call_or_end(entry) if self.ends_turns_at_eos else None
            if not entry.held:
                done.append(self._finish(entry.slot, reason or "stop"))
        elif self._spent(entry, len(entry.tokens)):
            done.append(self._finish(entry.slot, "length"))
        elif reason := self._call_or_end(entry):
            done.append(self._finish(entry.slot, reason))

    def _spent(self, entry: _Running, n: int) -> bool:
        """Whether n tokens use up the request's budget."""
        return n >= token_budget(entry.request, self.max_len)

    def _occupy(self, entry: _Running, slot: int, now: float) -> None:
        req, p = entry.request, entry.request.params
        entry.slot, entry.start_time, entry.kv_version = slot, now, self.version
        self.running[req.request_id] = entry
        self.slot_owner[slot] = entry
        self.temperature[slot].fill_(p.temperature)  # fill_: `t[i] = x` copies x from the host, a sync on CUDA
        self.top_p[slot].fill_(p.top_p)
        self.claimed_temperature[slot].fill_(p.logprob_temperature or p.temperature)
        self.claims[slot].fill_(p.temperature > 0 and p.logprob_temperature is not None)
        if p.temperature > 0:  # token i always uses uniform i: a resumed seeded sample stays reproducible
            seed = p.seed if p.seed is not None else zlib.crc32(f"{self.seed}:{req.request_id}".encode())
            n = min(p.max_new_tokens, self.max_len)
            gen = torch.Generator().manual_seed(seed)
            self.uniforms[slot, :n] = self._to_device(torch.rand(n, generator=gen))

    @staticmethod
    def _sampling_mode(params: list) -> tuple[bool, bool, bool]:
        """What a batch's sampling computes, decided on the host from its requests' parameters (no read from the
        device): whether any row samples, any samples from a nucleus, any records a claimed temperature."""
        return (any(p.temperature > 0 for p in params), any(p.temperature > 0 and p.top_p < 1 for p in params),
                any(p.logprob_temperature is not None for p in params))

    def _sample(self, rows: Tensor, index: Tensor, logits: Tensor, mode: tuple) -> tuple[Tensor, Tensor]:
        """Greedy at temperature 0, else temperature + top-p by inverse CDF on the slot's uniform `index`.
        The behaviour log-prob is the token's under the distribution it was drawn from: at temperature T,
        renormalised over the nucleus when top_p < 1 (the trainer scores it the same way). Each row's result
        is its own, whatever the batch and its `mode` (_sampling_mode: which parts are computed at all)."""
        sampled, nucleus_any, claims_any = mode
        if not sampled:
            tokens = logits.argmax(dim=-1)
            return tokens, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
        temp = self.temperature[rows]
        greedy = temp == 0
        logp = (logits / torch.where(greedy, 1.0, temp)[:, None]).log_softmax(-1)
        u = self.uniforms[rows, index, None]
        tokens = torch.where(greedy, logits.argmax(dim=-1), self._inverse_cdf(logp.exp(), u))
        logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
        if nucleus_any:
            top_p = self.top_p[rows]
            nucleus = ~greedy & (top_p < 1)
            in_tokens, in_logprobs = self._nucleus(logp, top_p, u)
            tokens, logprobs = torch.where(nucleus, in_tokens, tokens), torch.where(nucleus, in_logprobs, logprobs)
        if claims_any:  # the friction testbed: record a false claim
            claimed = (logits / torch.where(greedy, 1.0, self.claimed_temperature[rows])[:, None]).log_softmax(-1)
            logprobs = torch.where(self.claims[rows], claimed.gather(1, tokens[:, None]).squeeze(1), logprobs)
        return tokens, logprobs

    @classmethod
    def _nucleus(cls, logp: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """A token drawn from the smallest set of most likely tokens holding top_p, and its log-prob there."""
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        kept = sorted_logp.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], float("-inf"))
        at = cls._inverse_cdf(kept.exp(), u)[:, None]
        return order.gather(1, at).squeeze(1), kept.gather(1, at).squeeze(1) - kept.logsumexp(-1)

    @staticmethod
    def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
        """The token whose CDF interval holds u * total (u in [0, 1)); zero-probability tokens never win."""
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1).squeeze(1)

    def _finish(self, slot: int, reason: str) -> Completion:
        entry = self.slot_owner[slot]
        self.slot_owner[slot] = None
        del self.running[entry.request.request_id]
        return self._completion(entry, reason)

    def _completion(self, entry: _Running, reason: str) -> Completion:
        """What the entry holds so far; a waiting one (slot -1) has only the tokens it resumed from."""
        r = entry.request
        return Completion(r.request_id, r.prompt_uid, list(r.prompt_ids), entry.tokens, entry.logprobs,
                          entry.versions, reason, text=self._decode(entry.tokens), slot=entry.slot,
                          submit_time=entry.submit_time,
                          start_time=entry.start_time or time.time(), end_time=time.time(),
                          stale_kv_tokens=entry.stale_kv_tokens, **self._conversation_of(entry))

    def validate(self, req: Request) -> None:
        check_request(req, self.model.vocab, self.max_len)
