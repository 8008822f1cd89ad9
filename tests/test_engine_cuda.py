"""The built-in engine on a CUDA GPU (skipped elsewhere): greedy against transformers in float32 and bfloat16,
the CUDA-graph decode step against the eager one, one host sync per step, the memory it holds, and the split-KV
decode attention against float64 and SDPA."""
import dataclasses
import gc

import pytest
import torch

from helpers import float32_reorder_rel
from rlsys.rollout.attention import split_kv
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.types import Request, SamplingParams
from test_cpu_engine import (LONG, PROMPTS, SIZES, assert_near_float32_greedy, build, greedy, hf_greedy, hf_logprobs,
                             mixed_workload, run)
from test_decode_attention import BF16_EPS, SHAPES, inputs, reference

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, path = build(tmp_path_factory.mktemp("cuda"))
    return model.to(DEVICE), path


def test_float32_greedy_equals_transformers_generate(qwen):
    model, path = qwen
    engine = CPUEngine(path, slots=8, device=DEVICE)
    out = run(engine, [Request(f"r{i}", "p", p, greedy()) for i, p in enumerate(PROMPTS + [LONG])])
    for i, prompt in enumerate(PROMPTS + [LONG]):
        c = out[f"r{i}"]
        assert c.token_ids == hf_greedy(model, prompt, 20), f"prompt {i}"
        # GPU kernels chosen by shape sum float32 in other orders than transformers' own
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, prompt, c.token_ids), atol=1e-3, rtol=0)


def test_bfloat16_greedy_stays_within_its_rounding_of_float32_transformers(qwen):
    model, path = qwen
    engine = CPUEngine(path, slots=8, device=DEVICE, dtype="bfloat16")
    assert engine.model.k_cache.dtype == torch.bfloat16 and engine.model.k_cache.device.type == DEVICE
    out = run(engine, [Request(f"r{i}", "p", p, greedy()) for i, p in enumerate(PROMPTS + [LONG])])
    for i, prompt in enumerate(PROMPTS + [LONG]):
        assert_near_float32_greedy(model, prompt, out[f"r{i}"])


def test_the_graph_step_samples_token_for_token_what_the_eager_step_samples(qwen):
    """float32: the same tokens; log-probs within what other kernels' summation orders give (padded shapes)."""
    _, path = qwen
    eager = run(CPUEngine(path, slots=4, device=DEVICE, decode="eager"), *mixed_workload())
    engine = CPUEngine(path, slots=4, device=DEVICE)
    assert engine.decode == "graph"
    graphed = run(engine, *mixed_workload())
    assert sorted(graphed) == sorted(eager)
    for rid, c in eager.items():
        assert graphed[rid].token_ids == c.token_ids, rid
        torch.testing.assert_close(torch.tensor(graphed[rid].logprobs), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
    assert len(engine.graphs.graphs) > 1
    engine.sleep(1)
    engine.wake_up()  # a new KV cache: captured again
    again = run(engine, *mixed_workload())
    assert all(again[rid].token_ids == c.token_ids for rid, c in eager.items())


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_one_host_sync_per_step(qwen, decode):
    """CUDA's sync debug mode raises on any synchronising call; only `_fetch` may sync, once a step."""
    _, path = qwen
    engine = CPUEngine(path, slots=3, device=DEVICE, dtype="bfloat16", decode=decode)
    fetch, fetches = engine._fetch, []

    def allowed_fetch(tokens, logprobs):
        fetches.append(len(tokens))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return fetch(tokens, logprobs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    params = [greedy(12), SamplingParams(16, 1.0, 0.9, seed=1), SamplingParams(8, 0.7, seed=2), greedy(5)]
    # lazy CUDA set-up, and every graph this workload replays captured (a capture synchronises)
    run(engine, [Request(f"warm-up{i}", "p", PROMPTS[i], p) for i, p in enumerate(params)])
    engine._fetch = allowed_fetch
    for i, p in enumerate(params):
        engine.add(Request(f"r{i}", "p", PROMPTS[i], p))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, steps = {}, 0
        while engine.has_work():
            out.update((c.request_id, c) for c in engine.step())
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(fetches) == steps and sorted(out) == ["r0", "r1", "r2", "r3"]
    assert [out[f"r{i}"].num_tokens for i in range(4)] == [12, 16, 8, 5]


def test_memory_is_weights_cache_and_sampling_state_and_does_not_grow(tmp_path):
    # room for 4096 positions: a cache (64 MiB) large beside a 64-request prefill's activations (5 MB on an H100)
    _, path = build(tmp_path, sizes=dict(SIZES, max_position_embeddings=4096))
    gc.collect()  # engines of earlier tests
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = CPUEngine(path, slots=64, max_len=4096, device=DEVICE, dtype="bfloat16")
    m = engine.model
    state = [m.embed, m.norm, m.cos, m.signed_sin, m.kv_mask, m.k_cache, m.v_cache, engine.last_token,
             engine.temperature, engine.top_p, engine.claimed_temperature, engine.claims, engine.uniforms,
             engine.step_inputs, engine.step_tokens, engine.step_logprobs, engine.rows]
    state += [m.lm_head] if m.lm_head is not m.embed else []
    state += [t for b in m.blocks for t in b.values() if t is not None]
    expected = sum(t.numel() * t.element_size() for t in state)
    del state  # its references would keep the cache alive through the sleep below
    held = torch.cuda.memory_allocated() - before
    assert expected <= held <= expected + 2**20  # nothing else kept; the allocator rounds blocks up
    cache = m.k_cache.numel() * m.k_cache.element_size() * 2
    assert m.max_len == 4096
    torch.cuda.reset_peak_memory_stats()
    after = []
    for wave in range(2):
        run(engine, [Request(f"{wave}-{i}", "p", PROMPTS[i % 5] * (1 + i % 3), greedy(40)) for i in range(64)])
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated() - before)
    assert after[1] == after[0]  # nothing left behind by a wave: the first captured the graphs the second replays
    engine.sleep(1)  # the graphs' pool goes with the cache it reads
    mask = m.kv_shape[1] * m.kv_shape[3] * 2
    assert torch.cuda.memory_allocated() - before <= expected - cache - mask + 2**20
    assert torch.cuda.max_memory_allocated() - before - held < cache / 4  # no copy of the cache, small activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,KV,G,K", SHAPES)
def test_split_kv_on_the_gpu_is_within_float32_and_bf16_rounding(n, KV, G, K, dtype):
    """cuBLAS's matmuls in place of the CPU's: float32 as SDPA (no TF32), bf16 within one spacing of the largest
    output (the bf16 scores' second term computed before its rounding, as cuBLAS's epilogue does in float32)."""
    assert not torch.backends.cuda.matmul.allow_tf32
    q, keys, values, mask = (t.to(DEVICE) for t in inputs(n, KV, G, K, dtype))
    expected = reference(q, keys, values, mask).cpu()
    error = (split_kv(q, keys, values, mask).double().cpu() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= (float32_reorder_rel(K * 64) if dtype == torch.float32 else BF16_EPS) * scale


def test_the_engine_samples_on_the_gpu_through_split_kv_what_it_samples_through_sdpa(qwen):
    """float32, graph step: the default attention on CUDA (split_kv) against SDPA's, long enough for two chunks."""
    _, path = qwen
    first, late = mixed_workload()
    first = [dataclasses.replace(r, prompt_ids=r.prompt_ids * 5) for r in first]
    engine = CPUEngine(path, slots=4, device=DEVICE)
    assert engine.attention == "split_kv" and engine.decode == "graph"
    split = run(engine, first, late)
    sdpa_run = run(CPUEngine(path, slots=4, device=DEVICE, attention="sdpa"), first, late)
    for rid, c in sdpa_run.items():
        assert split[rid].token_ids == c.token_ids, rid
        torch.testing.assert_close(torch.tensor(split[rid].logprobs), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
