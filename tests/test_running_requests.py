"""weights.running_requests on the built-in engine: at a new version, requests still generating either
recompute their KV cache under the new weights (their continuation is then exactly what the new model
alone would generate) or keep the old cache, and the tokens sampled over it are counted."""
import pytest
import torch

from rlsys.config import DEFAULT_CONFIG, ConfigError
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.startup import load_config
from rlsys.types import Request
from test_cpu_engine import PROMPTS, build, greedy, hf_greedy, run

BEFORE = 4  # tokens generated under the old weights: the prefill's and 3 decode steps'


def swap_mid_generation(tmp_path, running_requests: str):
    """A request generates BEFORE tokens under model 0, then model 1's weights arrive (version 7):
    (the finished completion, model 1)."""
    _, path = build(tmp_path, seed=0)
    other, _ = build(tmp_path, seed=1, name="other")
    engine = CPUEngine(path, slots=2, running_requests=running_requests)
    engine.add(Request("inflight", "p", PROMPTS[1], greedy(30)))
    for _ in range(BEFORE - 1):
        engine.step()
    engine.load_weights(other.state_dict(), version=7)
    return run(engine, [Request("fresh", "p", PROMPTS[0], greedy(10))]), other


def test_recompute_continues_exactly_as_the_new_weights_alone_would(tmp_path):
    out, other = swap_mid_generation(tmp_path, "recompute")
    c = out["inflight"]
    assert c.versions == [0] * BEFORE + [7] * (30 - BEFORE)
    head = c.token_ids[:BEFORE]
    assert c.token_ids[BEFORE:] == hf_greedy(other, PROMPTS[1] + head, 30 - BEFORE)  # no old key or value left
    assert c.stale_kv_tokens == 0 and out["fresh"].stale_kv_tokens == 0


def test_keep_goes_on_over_the_old_cache_and_counts_the_stale_tokens(tmp_path):
    kept, other = swap_mid_generation(tmp_path / "keep", "keep")
    recomputed, _ = swap_mid_generation(tmp_path / "recompute", "recompute")
    c = kept["inflight"]
    assert c.versions == [0] * BEFORE + [7] * (30 - BEFORE)
    assert c.stale_kv_tokens == 30 - BEFORE  # every token after the update was sampled over old keys and values
    assert kept["fresh"].stale_kv_tokens == 0  # started under the new weights
    assert c.token_ids[:BEFORE] == recomputed["inflight"].token_ids[:BEFORE]
    old_kv = torch.tensor(c.logprobs[BEFORE:BEFORE + 1])
    assert not torch.allclose(old_kv, torch.tensor(recomputed["inflight"].logprobs[BEFORE:BEFORE + 1]))


def test_running_requests_is_checked():
    assert load_config(DEFAULT_CONFIG, []).weights.running_requests == "recompute"
    with pytest.raises(ConfigError, match="weights.running_requests: Input should be 'recompute' or 'keep'"):
        load_config(DEFAULT_CONFIG, ["weights.running_requests=sometimes"])
