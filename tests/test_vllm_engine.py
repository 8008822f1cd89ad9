"""The vLLM engine against transformers on a tiny random model (needs vLLM and a GPU, else skipped),
and the engine choice, which runs anywhere."""
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from rlsys.rollout.registry import make_engine
from rlsys.types import Request, SamplingParams
from test_cpu_engine import build, greedy, hf_greedy, hf_logprobs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not (HAVE_VLLM and torch.cuda.is_available()),
                                reason="needs vLLM and a CUDA GPU (the CPU engine is tested in test_cpu_engine.py)")
# head_dim 64: a size every vLLM attention backend takes. No EOS: runs are cut by length only.
SIZES = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 40, 33, 2, 2, 8, 1, 0, 63, 17, 21]]


def test_unknown_engine_is_refused_with_the_config_field():
    with pytest.raises(ValueError, match="rollout.engine: unknown rollout engine 'tpu'"):
        make_engine("tpu", "unused", 4)


@pytest.mark.skipif(HAVE_VLLM, reason="checks the message shown where vLLM is missing")
def test_vllm_engine_without_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, even if a stray copy exists
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine sets it; keep it out of other tests
    with pytest.raises(ImportError, match="rollout.engine=vllm needs vLLM"):
        make_engine("vllm", "unused", 4)


def test_cpu_engine_is_still_the_default_choice(tmp_path):
    _, path = build(tmp_path)
    engine = make_engine("cpu", path, 2)
    engine.add(Request("r", "p", [1, 2, 3], greedy(4)))
    done = []
    while engine.has_work():
        done += engine.step()
    assert done[0].num_tokens == 4 and done[0].finish_reason == "length"


# --- on a GPU with vLLM ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return build(root, seed=0, name="a", sizes=SIZES), build(root, seed=1, name="b", sizes=SIZES)


@pytest.fixture(scope="module")
def engine(models):
    from rlsys.rollout.vllm_engine import VLLMEngine

    (_, path), _ = models
    return VLLMEngine(path, slots=4, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True)


def run(engine, requests, steps=None):
    """Step until done (or `steps` steps); returns {request_id: Completion}."""
    for r in requests:
        engine.add(r)
    out, n = {}, 0
    while engine.has_work() and (steps is None or n < steps):
        out.update((c.request_id, c) for c in engine.step())
        n += 1
    return out


@needs_vllm
def test_greedy_matches_transformers(engine, models):
    (model, _), _ = models
    out = run(engine, [Request(f"g{i}", "p", p, greedy(16)) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        c = out[f"g{i}"]
        expected = hf_greedy(model, prompt, 16)
        assert c.token_ids == expected and c.finish_reason == "length", f"prompt {i}"
        assert c.versions == [engine.version] * 16
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, prompt, expected), atol=2e-3, rtol=0)


@needs_vllm
def test_abort_returns_the_tokens_so_far(engine):
    out = run(engine, [Request("a", "p", PROMPTS[1], greedy(64))], steps=6)
    assert "a" not in out
    [c] = engine.abort(["a", "never-added"])
    assert c.finish_reason == "abort" and 0 < c.num_tokens < 64
    assert len(c.logprobs) == len(c.versions) == c.num_tokens
    assert not engine.has_work() and engine.abort(["a"]) == []


@needs_vllm
def test_resume_continues_where_the_abort_stopped(engine):
    whole = run(engine, [Request("w", "p", PROMPTS[3], greedy(24))])["w"]
    run(engine, [Request("r", "p", PROMPTS[3], greedy(24))], steps=5)
    [cut] = engine.abort(["r"])
    resumed = Request("r", "p", PROMPTS[3], greedy(24), resume_ids=cut.token_ids,
                      resume_logprobs=[-1.0] * cut.num_tokens, resume_versions=[-7] * cut.num_tokens)
    c = run(engine, [resumed])["r"]
    assert c.token_ids == whole.token_ids and c.finish_reason == "length"
    k = cut.num_tokens  # resumed tokens keep what was recorded for them
    assert c.logprobs[:k] == [-1.0] * k and c.versions[:k] == [-7] * k
    torch.testing.assert_close(torch.tensor(c.logprobs[k:]), torch.tensor(whole.logprobs[k:]), atol=2e-3, rtol=0)


@needs_vllm
def test_our_eos_ids_stop_a_request_and_stay_in_its_tokens(engine, monkeypatch):
    whole = run(engine, [Request("e0", "p", PROMPTS[1], greedy(16))])["e0"]
    eos = whole.token_ids[5]
    k = whole.token_ids.index(eos) + 1
    monkeypatch.setattr(engine, "eos_ids", {eos})  # read when a request is added
    c = run(engine, [Request("e1", "p", PROMPTS[1], greedy(16))])["e1"]
    assert c.finish_reason == "stop" and c.token_ids == whole.token_ids[:k]


@needs_vllm
def test_temperature_vllm_refuses_is_a_value_error_naming_the_field(engine):
    with pytest.raises(ValueError, match="request t: params.temperature must be <= 2"):
        engine.validate(Request("t", "p", PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=2.5)))


@needs_vllm
def test_load_weights_changes_outputs_and_tags_the_version(engine, models):
    (model_a, path_a), (model_b, _) = models
    engine.load_weights({k: v.clone() for k, v in model_b.state_dict().items()}, version=3)
    try:
        c = run(engine, [Request("b", "p", PROMPTS[0], greedy(16))])["b"]
        assert c.token_ids == hf_greedy(model_b, PROMPTS[0], 16) != hf_greedy(model_a, PROMPTS[0], 16)
        assert c.versions == [3] * 16 and engine.stats()["version"] == 3
    finally:
        engine.load_weights(model_a.state_dict(), version=4)  # model a again, as a newer version: no older one loads


# --- weight versions: when the prefix cache is reset, on any machine -----------------------------------
class RecordingLLM:
    """vLLM's LLMEngine, as far as a weight version and sleep touch it: records the calls."""

    def __init__(self):
        self.calls = []
        self.model_config = SimpleNamespace(dtype=torch.float32)

    def collective_rpc(self, method, args=()):  # a weight load reaching the workers
        self.calls.append((method,))

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))


def bare_vllm_engine(running_requests):
    """A VLLMEngine around the recorder (no vLLM here): its own sleep, wake and version handling."""
    from rlsys.rollout.vllm_engine import VLLMEngine, _Sample

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.name, engine.version, engine.running_requests, engine.samples = "vllm engine", 0, running_requests, {}
    engine.llm = RecordingLLM()
    return engine, _Sample


@pytest.mark.parametrize("running_requests", ["recompute", "keep"])
def test_a_version_preempts_running_requests_only_when_there_are_some_to_recompute(running_requests):
    engine, sample = bare_vllm_engine(running_requests)
    engine.has_work = lambda: bool(engine.samples)
    # colocated: the version loads between waking the weights and the KV cache, which sleep emptied
    engine.sleep(2)
    engine.wake_up(["weights"])
    engine._weights_changed(1)
    engine.wake_up(["kv_cache"])
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    engine.llm.calls.clear()
    engine._weights_changed(2)  # awake, nothing held: the prefix cache goes, nothing to preempt
    engine.samples["r"] = sample(Request("r", "p", [1], greedy(4)), 0.0)
    engine._weights_changed(3)  # awake with a running request (separate layout, async)
    assert engine.llm.calls == [("reset_prefix_cache", False),
                                ("reset_prefix_cache", running_requests == "recompute")]
    assert engine.samples["r"].kv_version == (3 if running_requests == "recompute" else 0)


def test_a_weight_version_older_than_the_one_held_is_refused_before_it_loads():
    engine, _ = bare_vllm_engine("recompute")
    engine._weights_changed(3)
    engine.llm.calls.clear()
    weights = {"model.norm.weight": torch.ones(4)}

    def update(version):  # each engine worker receives the buckets itself
        return SimpleNamespace(version=version, receiver=SimpleNamespace(per_worker=True))
    message = "vllm engine: refused weights version 2, older than the version 3 it holds"
    with pytest.raises(RuntimeError, match=message):
        engine.load_weights(weights, version=2)
    with pytest.raises(RuntimeError, match=message):
        engine.receive_weights(update(2))  # refused before its buckets are read
    assert engine.version == 3 and engine.llm.calls == []  # nothing reached the engine
    # The same version again loads through the stand-in (a replaced worker): the refusal alone stopped the above.
    engine.load_weights(weights, version=3)
    engine.receive_weights(update(3))
    assert [c[0] for c in engine.llm.calls] == ["rlsys_load_bucket", "reset_prefix_cache", "rlsys_receive",
                                                "reset_prefix_cache"]
