"""Decode attention of the built-in engine: one new query per sequence over its cached keys.

q [n, KV, G, D] (a kv group's G query heads share its keys, as the query length), keys and values
[n, KV, K, D] (views of the KV cache), mask [n, 1, 1, K] (additive: 0 or -inf). Returns [n, KV, G, D].

`sdpa`: torch's fused attention. With a mask, its memory-efficient CUDA kernel parallelises over sequences x kv
heads x query blocks only (2 thread blocks at 1 sequence of the 0.47B bench model), each walking all K keys: on an
H100 a step at 4096 keys took 7.2 ms against 1.8 ms at 128 (benchmarks/results/gpu_engine_graph_h100.json).
`split_kv` (flash-decoding's split in plain torch ops): the scores of all keys in one batched matmul (cuBLAS tiles
the keys), their softmax statistics in float32, then the keys split into chunks of CHUNK_KEYS as the batch of the
probabilities-values matmul, whose partial outputs sum to the output. Flash-decoding keeps per-chunk softmax
statistics and combines the chunks by log-sum-exp weights because its kernel never holds all the scores; here they
are in memory anyway, so the statistics (max, sum) are the whole row's and the combine is a sum: about 17 kernels
a call, where a graph-launched step pays for each. Static shapes, no host sync, no data-dependent branch: it
captures in a CUDA graph.

Which one runs (DECODE_ATTENTION, a CPUEngine's `attention`): split_kv on CUDA, for the eager and the graph step
alike, so both sample by the same arithmetic up to float32's reordering (split_kv itself hands short keys and large
batches to sdpa, by the shapes each step gives it); sdpa on the CPU, where split_kv measured slower
(benchmarks/results/decode_attention_cpu.json).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_KEYS = 128  # keys per chunk: 32 chunks at 4096 keys; the short buckets (<= 128) are one
# Split only while SDPA's grid (sequences x kv heads thread blocks) is smaller than an H100's 132 SMs: by arithmetic
# (unmeasured) the split's memory traffic, about 4x SDPA's over the keys, costs more than SDPA's walk once every SM
# has a block of its own (SDPA: 12.2 ms at 256 x 4096, gpu_engine_graph_h100.json).
SPLIT_BELOW_ROWS = 128
MASKED = -1e30  # a masked score: exp of it is 0 beside any real score, and it is finite


def sdpa(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def split_kv(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention by chunks of keys. To sdpa instead: keys that fit one chunk, where it has nothing to split and runs
    as one kernel (the short contexts stay as measured), and a batch whose sequences x kv heads reach
    SPLIT_BELOW_ROWS. Both are decided by shapes alone, as a graph needs.
    Precision as SDPA's CUDA kernel keeps it: scores, softmax statistics and the chunks' sum in float32; only the
    unnormalised probabilities meet the values in the input dtype (as in SDPA's second matmul). A bf16 matmul
    accumulates in float32 but rounds its output to bf16, up to a relative 2**-9 of each score (0.03 at a score of
    16, 3% on its weight): so a second matmul adds back what the rounding took, q.k - bf16(q.k), computed before its
    own rounding, and the scores carry 8 bits more (float32 inputs need no second one)."""
    n, KV, G, D = q.shape
    K = keys.shape[2]
    if K <= CHUNK_KEYS or n * KV >= SPLIT_BELOW_ROWS:
        return sdpa(q, keys, values, mask)
    chunks = -(-K // CHUNK_KEYS)
    q3, keys3 = q.reshape(n * KV, G, D), keys.reshape(n * KV, K, D).transpose(1, 2)  # keys: a view, no copy
    rounded = torch.bmm(q3, keys3)
    scores = rounded.float()
    if rounded.dtype != torch.float32:
        scores += torch.baddbmm(rounded, q3, keys3, beta=-1)
    # a finite mask: a row with every key masked (an idle row of the static step, its output dropped) gets a
    # uniform softmax, not NaN
    finite = mask.clamp_min(MASKED)
    scores = torch.add(finite, scores.view(n, KV, G, K), alpha=1 / math.sqrt(D))  # float32 [n, KV, G, K]
    # unnormalised, as in SDPA's CUDA kernel: the largest weight is exactly 1 in bf16 too, the sum divides in float32
    p = (scores - scores.amax(-1, keepdim=True)).exp_()
    total = p.sum(-1, keepdim=True)
    pad = chunks * CHUNK_KEYS - K
    if pad:  # eager steps attend to any key count, the static step's last bucket (max_len) too
        p, values = F.pad(p, (0, pad)), F.pad(values, (0, 0, 0, pad))
    p = p.view(n, KV, G, chunks, CHUNK_KEYS).transpose(2, 3).to(values.dtype, memory_format=torch.contiguous_format)
    v = values.reshape(n * KV * chunks, CHUNK_KEYS, D)  # the chunks as the batch: a copy of the cache's view
    part = torch.bmm(p.reshape(n * KV * chunks, G, CHUNK_KEYS), v)
    return part.view(n, KV, chunks, G, D).sum(2, dtype=torch.float32).div_(total).to(q.dtype)


DECODE_ATTENTION = {"sdpa": sdpa, "split_kv": split_kv}


def default_attention(device: torch.device) -> str:
    return "split_kv" if device.type == "cuda" else "sdpa"
