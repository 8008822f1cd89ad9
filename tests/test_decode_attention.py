"""The split-KV decode attention (rlsys/rollout/attention.py) against torch's SDPA and a float64 reference, on the
shapes the engine gives it, and through the engine's real decode steps on the CPU (on CUDA it is the default)."""
import dataclasses
import math

import pytest
import torch

from helpers import float32_reorder_rel
from rlsys.rollout.attention import (CHUNK_KEYS, DECODE_ATTENTION, SPLIT_BELOW_ROWS, default_attention, sdpa,
                                     split_kv)
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.shapes import KEYS_FINE, buckets
from test_cpu_engine import FakeDriver, FakeGraphs, assert_same_completions, mixed_workload, qwen, run  # noqa: F401

BF16_EPS = 2.0 ** -7  # bfloat16's spacing at 1.0


def inputs(n, KV, G, K, dtype, seed=0):
    """Queries, keys and values of the engine's decode shapes (keys and values views of a longer cache, as the
    engine's are), scores up to ~30 (a trained model's sinks), and an additive mask: sequence 1 sees its first
    K // 3 keys only (whole chunks masked), the last sequence none at all (an idle row of the static step)."""
    g = torch.Generator().manual_seed(seed)
    D = 64
    q = (2 * torch.randn(n, KV, G, D, generator=g)).to(dtype)
    cache = (2 * torch.randn(2, n, KV, K + 7, D, generator=g)).to(dtype)
    mask = torch.zeros(n, 1, 1, K)
    if n > 2:
        mask[1, ..., max(1, K // 3):] = float("-inf")
        mask[-1] = float("-inf")
    return q, cache[0, :, :, :K], cache[1, :, :, :K] / 2, mask.to(dtype)


def reference(q, keys, values, mask):
    """Attention in float64; a row with every key masked gives zeros."""
    q, keys, values, mask = (t.double() for t in (q, keys, values, mask))
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, -1).nan_to_num(0.0) @ values


SHAPES = [(1, 2, 8, 1), (3, 2, 8, 5), (4, 2, 8, CHUNK_KEYS), (3, 1, 4, CHUNK_KEYS + 1), (1, 2, 8, 2 * CHUNK_KEYS),
          (5, 2, 8, 300), (3, 4, 1, 1024), (2, 2, 8, 4096)]  # (sequences, kv heads, group, keys): 1 to 32 chunks,
# the last ragged or whole


@pytest.mark.parametrize("n,KV,G,K", SHAPES)
def test_split_kv_equals_sdpa_in_float32(n, KV, G, K):
    q, keys, values, mask = inputs(n, KV, G, K, torch.float32)
    out, expected = split_kv(q, keys, values, mask), reference(q, keys, values, mask)
    assert out.shape == (n, KV, G, 64) and out.dtype == torch.float32
    if n > 2:
        assert torch.isfinite(out[-1]).all()  # every key masked (an idle row, its output dropped): not NaN
        expected, out, q, keys, values, mask = (t[:-1] for t in (expected, out, q, keys, values, mask))
    scale = expected.abs().max().item()
    bound = float32_reorder_rel(K * 64) * scale  # scores sum 64 products, the output K weighted values
    torch.testing.assert_close(out.double(), expected, atol=bound, rtol=0)
    torch.testing.assert_close(out, sdpa(q, keys, values, mask), atol=2 * bound, rtol=0)


@pytest.mark.parametrize("n,K", [(3, 1), (3, 5), (3, CHUNK_KEYS), (SPLIT_BELOW_ROWS // 2, 300)])
def test_keys_that_fit_one_chunk_and_batches_that_fill_the_gpu_go_to_sdpa(n, K):
    """Nothing to split, or every SM busy already: SDPA's one kernel, not split_kv's ~25."""
    for dtype in (torch.float32, torch.bfloat16):
        q, keys, values, mask = inputs(n, 2, 8, K, dtype)
        assert torch.equal(split_kv(q, keys, values, mask), sdpa(q, keys, values, mask))
    q, keys, values, mask = inputs(SPLIT_BELOW_ROWS // 2 - 1, 2, 8, 300, torch.float32)  # one row fewer: split
    assert not torch.equal(split_kv(q, keys, values, mask), sdpa(q, keys, values, mask))


@pytest.mark.parametrize("n,KV,G,K", SHAPES)
def test_split_kv_in_bfloat16_is_within_its_rounding(n, KV, G, K):
    """SDPA's kernels keep the scores in float32; so does split_kv (a single bf16 matmul would round a score
    of 30 by 0.06, 6% on its weight: the scores' second term keeps this bound; the output's own rounding is half
    of it)."""
    q, keys, values, mask = inputs(n, KV, G, K, torch.bfloat16)
    rows = slice(0, n - 1 if n > 2 else n)  # the last sequence's keys all masked (see inputs)
    expected = reference(q, keys, values, mask)[rows]
    error = (split_kv(q, keys, values, mask)[rows].double() - expected).abs().max().item()
    assert error <= BF16_EPS * expected.abs().max().item()


def test_one_rounded_bf16_matmul_for_the_scores_would_not_be_within_that_bound():
    """What the bound above catches: the scores as a plain bf16 matmul rounds them."""
    q, keys, values, mask = inputs(3, 2, 8, 1024, torch.bfloat16)
    rounded = (q @ keys.transpose(-1, -2)).double() / 8 + mask.double()
    plain = torch.softmax(rounded, -1).nan_to_num(0.0) @ values.double()  # all else exact
    expected = reference(q, keys, values, mask)
    assert (plain - expected).abs().max().item() > BF16_EPS * expected.abs().max().item()


def test_the_static_steps_key_buckets_are_whole_chunks_but_the_last():
    """The static step's key counts: one chunk up to CHUNK_KEYS, whole chunks above, but max_len (padded)."""
    for limit in (100, 640, 1000, 4096, 8192):
        sizes = buckets(limit, KEYS_FINE)
        assert all(K <= CHUNK_KEYS or K % CHUNK_KEYS == 0 for K in sizes[:-1]), limit


def test_split_kv_is_the_decode_attention_on_cuda_and_sdpa_on_the_cpu(qwen):
    _, path = qwen
    assert default_attention(torch.device("cuda")) == "split_kv" and default_attention(torch.device("cpu")) == "sdpa"
    engine = CPUEngine(path, slots=2)
    assert engine.attention == "sdpa" and engine.model.attend is DECODE_ATTENTION["sdpa"]
    assert CPUEngine(path, slots=2, attention="split_kv").model.attend is split_kv
    with pytest.raises(ValueError, match="attention='flash': one of sdpa, split_kv"):
        CPUEngine(path, slots=1, attention="flash")


@pytest.mark.parametrize("mode", ["eager", "static", "graph"])
def test_the_engine_samples_through_split_kv_what_it_samples_through_sdpa(qwen, monkeypatch, mode):
    """float32, same seeds: the same tokens through each decode step CUDA runs (the graph step on the CUDA
    stand-in), with prompts long enough that the keys span two chunks, the eager step's a ragged last one."""
    _, path = qwen
    first, late = mixed_workload()
    first = [dataclasses.replace(r, prompt_ids=r.prompt_ids * 5) for r in first]  # up to 165 + 60 keys
    sdpa_run = run(CPUEngine(path, slots=4), first, late)
    if mode == "graph":
        FakeDriver().install(monkeypatch)
        FakeGraphs().install(monkeypatch)
    engine = CPUEngine(path, slots=4, decode=mode, attention="split_kv")
    assert_same_completions(sdpa_run, run(engine, first, late))
