"""The built-in CPU engine: a Qwen2/Llama decoder with a static slot KV cache and continuous batching.

Written from scratch: transformers' generate runs a fixed batch to its longest member and costs about
3x more CPU per token on the tiny model (benchmarks/engine_throughput.py). Here one decode step runs
every active slot in one batched forward, and a waiting request takes a slot the moment one frees up.
Weights come from the model directory's Hugging Face safetensors and can be swapped between steps
(`load_weights`, or `receive_weights` bucket by bucket), tagging later tokens with a new version.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from rlsys.rollout.engine import (EngineCounters, RolloutEngine, check_request, read_eos_ids, read_tokenizer,
                                  resume_finish_reason)
from rlsys.types import Completion, Request
from rlsys.weights import WeightGroup, WeightUpdate


def _read_config(model_dir: Path):
    from transformers import AutoConfig

    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    cfg = AutoConfig.from_pretrained(str(model_dir))
    where = f"{model_dir / 'config.json'}"
    if cfg.model_type not in ("qwen2", "llama"):
        raise ValueError(f"{where}: model_type {cfg.model_type!r} is not supported by the CPU engine "
                         "(qwen2 or llama)")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported by the CPU engine")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{where}: mlp_bias=true is not supported by the CPU engine")
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


class DecoderModel:
    """The weights (q/k/v and gate/up fused for fewer matmuls) and a forward over the slot KV cache."""

    def __init__(self, model_dir: Path, slots: int, max_len: int | None, dtype: torch.dtype):
        cfg = _read_config(model_dir)
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
            return torch.zeros(*shape, dtype=dtype)

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
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float32), inv_freq)
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype)
        # rotate_half(x) * sin == roll(x, D/2) * sin with the first half negated: one op fewer per step
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)
        self.positions = torch.arange(self.max_len)
        self.k_cache = empty(self.layers, slots, KV, self.max_len, D)
        self.v_cache = empty(self.layers, slots, KV, self.max_len, D)

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

    def forward(self, ids: Tensor, pos: Tensor, slots: Tensor, kv_len: int, last: Tensor) -> Tensor:
        """ids, pos: [N, T] tokens and their positions, written to cache rows `slots` [N]; attends to
        the first kv_len cache positions (causally, by position). Returns logits at `last` [N] of T."""
        N, T = ids.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        G, NT = H // KV, N * T
        first = int(slots[0])
        contiguous = int(slots[-1]) - first + 1 == N  # slots taken in order: a view, not a gather
        rows = slice(first, first + N) if contiguous else slots
        flat_pos, flat_slots = pos.reshape(NT), slots.repeat_interleave(T)
        cos, sin = self.cos[flat_pos, None], self.signed_sin[flat_pos, None]  # [NT, 1, D]
        # Query heads of one kv group share its keys: fold them into the query length (no K/V copies).
        # An additive float mask, broadcast over the group, is the fastest form for CPU attention.
        allowed = self.positions[:kv_len] <= pos[:, :, None]  # [N, T, L]
        mask = torch.zeros(allowed.shape, dtype=self.cos.dtype).masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None] if T == 1 else mask[:, None, None].expand(N, 1, G, T, kv_len).reshape(N, 1, G * T, kv_len)
        x = F.embedding(ids.reshape(NT), self.embed)  # 2-D activations: faster matmuls on CPU than [N, T, d]
        for layer, b in enumerate(self.blocks):
            h = F.rms_norm(x, (self.hidden,), b["ln_in"], self.eps)
            qkv = F.linear(h, b["wqkv"], b["bqkv"])
            qk = qkv[:, : (H + KV) * D].view(NT, H + KV, D)
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # RoPE on q and k at once
            self.k_cache[layer][flat_slots, :, flat_pos] = qk[:, H:]
            self.v_cache[layer][flat_slots, :, flat_pos] = qkv[:, (H + KV) * D:].view(NT, KV, D)
            keys = self.k_cache[layer][rows, :, :kv_len]
            values = self.v_cache[layer][rows, :, :kv_len]
            q = qk[:, :H].reshape(N, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(N, KV, G * T, D)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            o = o.view(N, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(NT, H * D)
            x = torch.addmm(x, o, b["wo"].t())  # the residual add rides along with the matmul
            if b["bo"] is not None:
                x += b["bo"]
            h = F.rms_norm(x, (self.hidden,), b["ln_post"], self.eps)
            gate, up = F.linear(h, b["wgu"]).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, b["wdown"].t())
        if T > 1:
            x = x.view(N, T, self.hidden)[torch.arange(N), last]
        return F.linear(F.rms_norm(x, (self.hidden,), self.norm, self.eps), self.lm_head).float()


@dataclass
class _Running:
    request: Request
    submit_time: float
    start_time: float = 0.0
    slot: int = -1


class CPUEngine(RolloutEngine):
    def __init__(self, model_dir: str, slots: int, eos_token_id: int | None = None,
                 max_len: int | None = None, dtype: torch.dtype = torch.float32, name: str = "cpu engine",
                 seed: int = 0, running_requests: str = "recompute"):
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (got {slots})")
        path = Path(model_dir)
        with torch.inference_mode():
            self.model = DecoderModel(path, slots, max_len, dtype)
        self.name, self.slots, self.max_len, self.version = name, slots, self.model.max_len, 0
        self.seed = seed  # the run's: a request without a seed draws from (seed, request id), whatever engine runs it
        self.weight_group: WeightGroup | None = None  # joined for a transport that needs one (broadcast)
        self.running_requests = running_requests  # weights.running_requests: "recompute" or "keep"
        self.eos_ids = read_eos_ids(path, eos_token_id)
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.tokenizer = read_tokenizer(path)
        self.waiting: dict[str, _Running] = {}  # insertion order = arrival order
        self.running: dict[str, _Running] = {}
        self.slot_owner: list[_Running | None] = [None] * slots
        self.finished_early: list[Completion] = []  # resumed requests that had nothing left to do
        S, L = slots, self.max_len
        # Per-slot state as tensors so one step updates every slot without a Python loop.
        self.active = torch.zeros(S, dtype=torch.bool)
        self.seq_len = torch.zeros(S, dtype=torch.long)  # tokens in the cache
        self.last_token = torch.zeros(S, dtype=torch.long)  # sampled, not yet in the cache
        self.n_out = torch.zeros(S, dtype=torch.long)
        self.max_out = torch.zeros(S, dtype=torch.long)
        self.temperature = torch.zeros(S)
        self.top_p = torch.ones(S)
        self.out_tokens = torch.zeros(S, L, dtype=torch.long)
        self.out_logprobs = torch.zeros(S, L)
        self.out_versions = torch.zeros(S, L, dtype=torch.long)
        self.uniforms = torch.zeros(S, L)  # pre-drawn per request from its own seeded generator
        self.kv_version = torch.zeros(S, dtype=torch.long)  # the oldest weights in the slot's KV cache
        self.stale_kv = torch.zeros(S, dtype=torch.long)  # tokens sampled over KV from older weights
        self.counters = EngineCounters()

    # --- interface --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request {request.request_id}: request_id already in the engine")
        self.validate(request)
        entry = _Running(request, time.time())
        reason = resume_finish_reason(request, self.eos_ids, self.max_len)
        if reason:
            self.finished_early.append(self._waiting_completion(entry, reason))
        else:
            self.waiting[request.request_id] = entry

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        t0 = time.perf_counter()
        done, self.finished_early = self.finished_early, []
        new_tokens = self._admit(done)
        idx = self.active.nonzero().squeeze(1)
        if len(idx):
            n = len(idx)
            kv_len = int(self.seq_len[idx].max()) + 1
            logits = self.model.forward(self.last_token[idx, None], self.seq_len[idx, None], idx, kv_len,
                                        torch.zeros(n, dtype=torch.long))
            self.seq_len[idx] += 1
            self._emit(idx, logits, done)
            new_tokens += n
        self.counters.record(len(idx), self.slots, new_tokens, time.perf_counter() - t0)
        return done

    def abort(self, request_ids: list[str]) -> list[Completion]:
        out = []
        for rid in request_ids:
            if rid in self.waiting:
                out.append(self._waiting_completion(self.waiting.pop(rid), "abort"))
            elif rid in self.running:
                out.append(self._finish(self.running[rid].slot, "abort"))
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.finished_early)

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "slots": self.slots}

    @torch.inference_mode()
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False, source=f"weights version {version}")
        self._weights_changed(version)

    def init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str = "gloo",
                          timeout_s: float = 600.0) -> None:
        self.weight_group = WeightGroup(host, port, rank_offset, world_size, backend, timeout_s)

    @torch.inference_mode()
    def receive_weights(self, update: WeightUpdate) -> None:
        # Each bucket is a partial state dict (loaded with strict=False); the version changes after the last.
        source = f"{self.name}: weights version {update.version}"
        for weights in update.buckets(self.name, getattr(self, "device", "cpu"), self.weight_group):
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
        entries = list(self.running.values())
        slots = torch.tensor(sorted(e.slot for e in entries))
        seqs = [self.slot_owner[s].request.prompt_ids + self.out_tokens[s, :int(self.n_out[s]) - 1].tolist()
                for s in slots.tolist()]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq)
        lens = torch.tensor([len(seq) for seq in seqs])
        pos = torch.arange(ids.shape[1]).expand(len(seqs), -1)
        self.model.forward(ids, pos, slots, ids.shape[1], lens - 1)
        self.kv_version[slots] = self.version

    def _release(self, level: int) -> None:
        """Sleep frees the KV cache; the weights stay, as host memory is where a level-1 sleep would keep them
        and level 2's caller loads new ones anyway."""
        m = self.model
        self._kv_layout = (m.k_cache.shape, m.k_cache.dtype)
        m.k_cache = m.v_cache = None

    def _reclaim(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            shape, dtype = self._kv_layout
            self.model.k_cache, self.model.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    # --- generation -------------------------------------------------------------------------
    def _admit(self, done: list[Completion]) -> int:
        """Move waiting requests into free slots with one batched prefill; returns tokens sampled."""
        free = (~self.active).nonzero().squeeze(1).tolist()
        take = min(len(free), len(self.waiting))
        if not take:
            return 0
        entries = [self.waiting.pop(next(iter(self.waiting))) for _ in range(take)]
        slots = torch.tensor(free[:take])
        seqs = [e.request.prompt_ids + e.request.resume_ids for e in entries]
        lens = torch.tensor([len(s) for s in seqs])
        ids = torch.zeros(take, int(lens.max()), dtype=torch.long)
        now = time.time()
        for i, (e, s) in enumerate(zip(entries, seqs)):
            ids[i, : len(s)] = torch.tensor(s)
            self._occupy(e, int(slots[i]), now)
        pos = torch.arange(ids.shape[1]).expand(take, -1)
        logits = self.model.forward(ids, pos, slots, ids.shape[1], lens - 1)
        self.seq_len[slots] = lens
        self.active[slots] = True
        self._emit(slots, logits, done)
        return take

    def _occupy(self, entry: _Running, slot: int, now: float) -> None:
        req, p = entry.request, entry.request.params
        entry.slot, entry.start_time = slot, now
        self.kv_version[slot], self.stale_kv[slot] = self.version, 0
        self.running[req.request_id] = entry
        self.slot_owner[slot] = entry
        r = len(req.resume_ids)
        self.n_out[slot] = r
        self.max_out[slot] = p.max_new_tokens
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        if r:
            self.out_tokens[slot, :r] = torch.tensor(req.resume_ids)
            self.out_logprobs[slot, :r] = torch.tensor(req.resume_logprobs)
            self.out_versions[slot, :r] = torch.tensor(req.resume_versions)
        if p.temperature > 0:  # token i always uses uniform i: a resumed seeded sample stays reproducible
            seed = p.seed if p.seed is not None else zlib.crc32(f"{self.seed}:{req.request_id}".encode())
            n = min(p.max_new_tokens, self.max_len)
            gen = torch.Generator().manual_seed(seed)
            self.uniforms[slot, :n] = torch.rand(n, generator=gen)

    def _emit(self, idx: Tensor, logits: Tensor, done: list[Completion]) -> None:
        """Sample one token for each slot in idx, record it, and finish the slots that are done."""
        tokens, logprobs = self._sample(idx, logits)
        n = self.n_out[idx]
        self.out_tokens[idx, n] = tokens
        self.out_logprobs[idx, n] = logprobs
        self.out_versions[idx, n] = self.version
        self.stale_kv[idx] += (self.kv_version[idx] < self.version).long()
        self.n_out[idx] = n + 1
        self.last_token[idx] = tokens
        stop = torch.isin(tokens, self.eos)
        # prompt + response never exceeds max_len, so the trainer can score the whole sequence
        length = (n + 1 >= self.max_out[idx]) | (self.seq_len[idx] + 1 >= self.max_len)
        for i in (stop | length).nonzero().squeeze(1).tolist():
            done.append(self._finish(int(idx[i]), "stop" if stop[i] else "length"))

    def _sample(self, idx: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Greedy at temperature 0, else temperature + top-p by inverse CDF on the slot's uniform.
        The behaviour log-prob is taken before top-p truncation."""
        temp = self.temperature[idx]
        greedy = temp == 0
        if bool(greedy.all()):
            tokens = logits.argmax(dim=-1)
            return tokens, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
        logp = (logits / torch.where(greedy, 1.0, temp)[:, None]).log_softmax(-1)
        probs = logp.exp()
        u = self.uniforms[idx, self.n_out[idx], None]
        sampled = self._inverse_cdf(probs, u)
        top_p = self.top_p[idx]
        nucleus = top_p < 1
        if bool(nucleus.any()):  # rows decide alone: a row's token never depends on its batch companions
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            kept = sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None])  # smallest set >= p
            in_nucleus = order.gather(1, self._inverse_cdf(kept, u)[:, None]).squeeze(1)
            sampled = torch.where(nucleus, in_nucleus, sampled)
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    @staticmethod
    def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
        """The token whose CDF interval holds u * total (u in [0, 1)); zero-probability tokens never win."""
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1).squeeze(1)

    def _finish(self, slot: int, reason: str) -> Completion:
        entry = self.slot_owner[slot]
        n = int(self.n_out[slot])
        self.active[slot] = False
        self.slot_owner[slot] = None
        del self.running[entry.request.request_id]
        return self._completion(entry, self.out_tokens[slot, :n].tolist(), self.out_logprobs[slot, :n].tolist(),
                                self.out_versions[slot, :n].tolist(), reason, slot, int(self.stale_kv[slot]))

    def _waiting_completion(self, entry: _Running, reason: str) -> Completion:
        r = entry.request
        return self._completion(entry, list(r.resume_ids), list(r.resume_logprobs), list(r.resume_versions),
                                reason, -1)

    def _completion(self, entry, tokens, logprobs, versions, reason, slot, stale_kv_tokens=0) -> Completion:
        r = entry.request
        return Completion(r.request_id, r.prompt_uid, list(r.prompt_ids), tokens, logprobs, versions, reason,
                          text=self._decode(tokens), slot=slot, submit_time=entry.submit_time,
                          start_time=entry.start_time or time.time(), end_time=time.time(),
                          stale_kv_tokens=stale_kv_tokens)

    def validate(self, req: Request) -> None:
        check_request(req, self.model.vocab, self.max_len)
