"""Decode attention of the built-in engine: one new query per sequence over its cached keys.

q [n, KV, G, D] (a kv group's G query heads share its keys, as the query length), keys and values
[n, KV, K, D] (views of the KV cache), mask [n, 1, 1, K] (additive: 0 or -inf). Returns [n, KV, G, D].

`sdpa`: torch's fused attention. With a mask, its memory-efficient CUDA kernel parallelises over sequences x kv
heads x query blocks only (2 thread blocks at 1 sequence of the 0.47B bench model), each walking all K keys: on an
H100 a step at 4096 keys took 7.2 ms against 1.8 ms at 128 (benchmarks/results/gpu_engine_graph_h100.json).
`split_kv` (flash-decoding in plain torch ops): the keys split into chunks of CHUNK_KEYS, each chunk's softmax
statistics and partial output computed in parallel, then combined by log-sum-exp weights. Static shapes, no host
sync, no data-dependent branch: it captures in a CUDA graph.

Which one runs (DECODE_ATTENTION): split_kv on CUDA, for the eager and the graph step alike (both sample the same
tokens by the same arithmetic); sdpa on the CPU, where one kernel already uses every core over the keys.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_KEYS = 128  # keys per chunk: 32 chunks at 4096 keys, one at the short buckets (<= 128)


def sdpa(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def split_kv(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention by chunks of keys. Precision as SDPA's kernels keep it: scores, softmax statistics and the
    combine in float32; only the probabilities meet the values in the input dtype (as SDPA's second matmul).
    A bf16 matmul accumulates in float32 but rounds its output to bf16, a relative 2**-9 of each score (0.03 at
    a score of 16, 3% on its weight): so a second matmul adds back what the rounding took, q.k - bf16(q.k),
    computed before its own rounding, and the scores carry 16 bits more (float32 inputs need no second one)."""
    n, KV, G, D = q.shape
    K = keys.shape[2]
    chunks = -(-K // CHUNK_KEYS)
    C = min(K, CHUNK_KEYS)
    pad = chunks * C - K  # eager steps attend to any key count; the static step's last bucket is max_len
    q3, keys3 = q.reshape(n * KV, G, D), keys.reshape(n * KV, K, D).transpose(1, 2)  # keys: a view, no copy
    rounded = torch.bmm(q3, keys3)
    scores = rounded.float()
    if rounded.dtype != torch.float32:
        scores += torch.baddbmm(rounded, q3, keys3, beta=-1)
    scores = torch.add(mask, scores.view(n, KV, G, K), alpha=1 / math.sqrt(D))  # float32 [n, KV, G, K]
    scores = F.pad(scores, (0, pad), value=float("-inf")).view(n, KV, G, chunks, C)
    # a chunk with every key masked: its max -inf would make exp(-inf - -inf) NaN; the lowest float gives 0
    top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    p = torch.exp(scores - top)
    total = p.sum(-1)  # [n, KV, G, chunks]
    v = F.pad(values, (0, 0, 0, pad)).reshape(n * KV * chunks, C, D)  # chunks as the batch: a copy
    part = torch.bmm(p.to(values.dtype).transpose(2, 3).reshape(n * KV * chunks, G, C), v)
    weight = torch.exp(top.squeeze(-1) - top.amax(-2))  # [n, KV, G, chunks], log-sum-exp rescaling
    out = torch.einsum("bkgc,bkcgd->bkgd", weight, part.view(n, KV, chunks, G, D).float())
    # every key masked (an idle row of the static step, its output dropped): zeros, not NaN
    return (out / (weight * total).sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).to(q.dtype)


DECODE_ATTENTION = {"sdpa": sdpa, "split_kv": split_kv}


def default_attention(device: torch.device) -> str:
    return "split_kv" if device.type == "cuda" else "sdpa"
