"""The CPU engine against transformers' own forward and generate, on tiny random-init models."""
import collections
import json
import math
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cuda_standin import FakeDriver, FakeGraphs, cuda_graphs  # noqa: F401 (a fixture)
from rlsys.rollout import builtin_engine
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.shapes import bucket, buckets
from test_multiturn import ANSWER, model_dir, run as run_tools, sampled, tags  # noqa: F401 (fixtures)
from rlsys.rollout.registry import register_engine
from rlsys.types import Request, SamplingParams

SIZES = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=256, initializer_range=0.2)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 9, 9, 9], [12, 40, 33, 2, 2, 8, 1, 0, 63, 17, 21]]


def build(tmp_path, arch="qwen2", seed=0, name="model", sizes=SIZES):
    """A random-init model saved under tmp_path/name: (model, path)."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**sizes))
    else:  # Llama with the options Qwen2 lacks: tied embeddings, o_proj bias, another rope_theta
        model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=True, attention_bias=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    model.eval().save_pretrained(tmp_path / name)
    return model, str(tmp_path / name)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(params=["eager", "static", "graph"])
def decode(request, monkeypatch) -> str:
    """Each way a decode step runs (builtin_engine.DECODE_MODES); "graph" replays CUDA graphs on their stand-ins."""
    if request.param == "graph":
        FakeDriver().install(monkeypatch)
        FakeGraphs().install(monkeypatch)
    return request.param


def greedy(n=20):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0, len(prompt) - 1: -1].cpu()
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def run(engine, requests, add_after: dict | None = None):
    """Run to the end; `add_after[k]` are requests added after k steps. Returns {request_id: Completion}."""
    for r in requests:
        engine.add(r)
    out, steps = {}, 0
    while engine.has_work() or (add_after and steps <= max(add_after)):
        for r in (add_after or {}).get(steps, []):
            engine.add(r)
        out.update((c.request_id, c) for c in engine.step())
        steps += 1
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_hf_generate_and_logprobs(tmp_path, arch, decode):
    model, path = build(tmp_path, arch)
    engine = CPUEngine(path, slots=8, decode=decode)
    out = run(engine, [Request(f"r{i}", "p", p, greedy()) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        c = out[f"r{i}"]
        expected = hf_greedy(model, prompt, 20)
        assert c.token_ids == expected, f"prompt {i}"
        assert c.finish_reason == "length" and c.versions == [0] * 20
        reference = hf_logprobs(model, prompt, expected)
        torch.testing.assert_close(torch.tensor(c.logprobs), reference, atol=1e-4, rtol=0)


def test_prefill_chunks_keep_order_and_the_padded_budget():
    assert builtin_engine.prefill_chunks([3, 5, 2, 8], 10) == [(0, 2), (2, 3), (3, 4)]  # 2 x 5 = 10 fits, 3 x 5 not
    assert builtin_engine.prefill_chunks([20, 1], 10) == [(0, 1), (1, 2)]  # longer than the budget: alone
    assert builtin_engine.prefill_chunks([4] * 6, 100) == [(0, 6)]
    assert builtin_engine.prefill_chunks([], 10) == []


def test_a_prefill_over_the_token_budget_runs_in_chunks_with_the_same_results(qwen, monkeypatch):
    model, path = qwen
    forwards = []
    original = builtin_engine.DecoderModel.forward
    monkeypatch.setattr(builtin_engine.DecoderModel, "forward",
                        lambda self, ids, *a, **k: forwards.append(tuple(ids.shape)) or original(self, ids, *a, **k))
    monkeypatch.setattr(builtin_engine, "PREFILL_TOKENS", 2 * max(map(len, PROMPTS)))
    engine = CPUEngine(path, slots=8)
    out = run(engine, [Request(f"r{i}", "p", p, greedy(6)) for i, p in enumerate(PROMPTS)])
    prefills = [shape for shape in forwards if shape[1] > 1]
    assert len(prefills) >= 2 and sum(n for n, _ in prefills) == len(PROMPTS)
    assert all(n * t <= builtin_engine.PREFILL_TOKENS for n, t in prefills)
    for i, prompt in enumerate(PROMPTS):
        assert out[f"r{i}"].token_ids == hf_greedy(model, prompt, 6), f"prompt {i}"
        reference = hf_logprobs(model, prompt, out[f"r{i}"].token_ids)
        torch.testing.assert_close(torch.tensor(out[f"r{i}"].logprobs), reference, atol=1e-4, rtol=0)


def test_request_joining_mid_flight_matches_running_alone(qwen, decode):
    model, path = qwen
    engine = CPUEngine(path, slots=4, decode=decode)
    early = [Request(f"early{i}", "p", p, greedy(30)) for i, p in enumerate(PROMPTS[:2])]
    late = Request("late", "p", PROMPTS[4], greedy(20))
    out = run(engine, early, add_after={5: [late]})
    assert out["late"].start_time > out["early0"].start_time
    assert out["late"].token_ids == hf_greedy(model, PROMPTS[4], 20)
    assert out["early0"].token_ids == hf_greedy(model, PROMPTS[0], 30)


def test_waiting_request_takes_the_first_freed_slot(qwen, decode):
    model, path = qwen
    engine = CPUEngine(path, slots=2, decode=decode)
    reqs = [Request("short", "p", PROMPTS[0], greedy(3)), Request("long", "p", PROMPTS[1], greedy(25)),
            Request("queued", "p", PROMPTS[2], greedy(10))]
    for r in reqs:
        engine.add(r)
    assert engine.load() == {"running": 0, "waiting": 3, "slots": 2}
    engine.step()
    assert engine.load() == {"running": 2, "waiting": 1, "slots": 2}
    out = run(engine, [])
    assert out["queued"].slot == out["short"].slot
    assert out["queued"].start_time >= out["short"].end_time
    assert out["queued"].token_ids == hf_greedy(model, PROMPTS[2], 10)


def test_abort_frees_the_slot_at_once_and_returns_partial_tokens(qwen, decode):
    model, path = qwen
    engine = CPUEngine(path, slots=1, decode=decode)
    engine.add(Request("a", "p", PROMPTS[1], greedy(40)))
    engine.add(Request("b", "p", PROMPTS[0], greedy(5)))
    for _ in range(3):
        assert engine.step() == []
    (cut,) = engine.abort(["a", "unknown-id"])
    assert cut.finish_reason == "abort" and 0 < cut.num_tokens < 40
    assert cut.token_ids == hf_greedy(model, PROMPTS[1], 40)[: cut.num_tokens]
    assert len(cut.logprobs) == len(cut.versions) == cut.num_tokens
    assert engine.load() == {"running": 0, "waiting": 1, "slots": 1}
    engine.add(Request("c", "p", PROMPTS[2], greedy(5)))
    (waiting_cut,) = engine.abort(["c"])  # never started: no tokens, no slot
    assert waiting_cut.finish_reason == "abort" and waiting_cut.token_ids == [] and waiting_cut.slot == -1
    out = run(engine, [])
    assert set(out) == {"b"} and out["b"].slot == cut.slot


def test_resume_continues_exactly_like_an_uninterrupted_run(qwen, decode):
    model, path = qwen
    engine = CPUEngine(path, slots=2, decode=decode)
    full = run(engine, [Request("full", "p", PROMPTS[3], greedy(24))])["full"]
    engine.add(Request("part", "p", PROMPTS[3], greedy(24)))
    for _ in range(4):
        engine.step()
    (part,) = engine.abort(["part"])
    resumed = Request("again", "p", PROMPTS[3], greedy(24), resume_ids=part.token_ids,
                      resume_logprobs=part.logprobs, resume_versions=part.versions)
    done = run(engine, [resumed])["again"]
    assert done.token_ids == full.token_ids and done.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(done.logprobs), torch.tensor(full.logprobs), atol=1e-5, rtol=0)
    # A resume that already used its whole budget comes straight back.
    spent = Request("spent", "p", PROMPTS[3], greedy(3), resume_ids=[1, 2, 3], resume_logprobs=[-1.0] * 3,
                    resume_versions=[0] * 3)
    assert run(engine, [spent])["spent"].token_ids == [1, 2, 3]


def test_load_weights_changes_outputs_and_version_tags(tmp_path, qwen, decode):
    model, path = qwen
    other, _ = build(tmp_path, seed=1, name="other")
    engine = CPUEngine(path, slots=2, decode=decode)
    engine.add(Request("inflight", "p", PROMPTS[0], greedy(30)))
    for _ in range(3):
        engine.step()  # 1 prefill token + 3 decode tokens under version 0
    engine.load_weights(other.state_dict(), version=7)
    out = run(engine, [Request("fresh", "p", PROMPTS[1], greedy(20))])
    assert out["inflight"].versions == [0] * 4 + [7] * 26
    assert out["fresh"].versions == [7] * 20
    assert out["fresh"].token_ids == hf_greedy(other, PROMPTS[1], 20) != hf_greedy(model, PROMPTS[1], 20)
    with pytest.raises(KeyError, match="model.layers.0.mlp.nope"):
        engine.load_weights({"model.layers.0.mlp.nope": torch.zeros(1)}, version=8)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)}, version=8)


def test_eos_is_kept_in_tokens_but_not_in_text(tmp_path, qwen):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    model, path = build(tmp_path, name="with_tokenizer")
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-"
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="a"))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    expected = hf_greedy(model, PROMPTS[1], 20)
    eos = expected[4]
    stop_at = expected.index(eos)
    engine = CPUEngine(path, slots=2, eos_token_id=eos)
    out = run(engine, [Request("r", "p", PROMPTS[1], greedy(20)), Request("len", "p", PROMPTS[1], greedy(2))])
    assert out["r"].finish_reason == "stop" and out["r"].token_ids == expected[: stop_at + 1]
    assert out["r"].text == "".join(chars[t] for t in expected[:stop_at])
    assert out["len"].finish_reason == "length" and out["len"].num_tokens == min(2, stop_at + 1)


def test_eos_from_model_config_and_full_cache(tmp_path, decode):
    model, path = build(tmp_path, name="eos_in_config")
    expected = hf_greedy(model, PROMPTS[0], 10)
    config = json.loads((tmp_path / "eos_in_config" / "config.json").read_text())
    (tmp_path / "eos_in_config" / "config.json").write_text(json.dumps(dict(config, eos_token_id=[expected[6]])))
    out = run(CPUEngine(path, slots=1, decode=decode), [Request("r", "p", PROMPTS[0], greedy(50))])["r"]
    assert out.finish_reason == "stop" and out.token_ids == expected[: expected.index(expected[6]) + 1]
    engine = CPUEngine(path, slots=1, eos_token_id=63, max_len=8, decode=decode)  # a 3-token prompt: room for 5
    out = run(engine, [Request("r", "p", PROMPTS[0], greedy(50))])["r"]
    assert out.finish_reason == "length" and out.token_ids == [t for t in expected if t != 63][:5]
    with pytest.raises(ValueError, match="request long: prompt of 11 tokens leaves no room in max_len=8"):
        engine.add(Request("long", "p", PROMPTS[4], greedy()))


def hf_nucleus_logprobs(model, prompt, tokens, temperature, top_p):
    """Each token's log-prob under the smallest set of most likely tokens holding top_p, renormalised."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].double()
    out = []
    for row, token in zip(logits, tokens):
        probs = (row / temperature).softmax(-1)
        nucleus, mass = [], 0.0
        for t in probs.argsort(descending=True).tolist():
            if mass >= top_p:
                break
            nucleus.append(t)
            mass += probs[t].item()
        assert token in nucleus
        out.append(math.log(probs[token].item() / mass))
    return torch.tensor(out, dtype=torch.float32)


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_sampled_distributions(qwen, decode):
    model, path = qwen
    engine = CPUEngine(path, slots=4, decode=decode)

    def sample(seed, top_p=1.0, companions=()):
        params = SamplingParams(max_new_tokens=25, temperature=0.7, top_p=top_p, seed=seed)
        return run(engine, [Request("s", "p", PROMPTS[1], params), *companions])["s"]

    first = sample(3)
    noisy = [Request(f"c{i}", "p", p, SamplingParams(30, 1.0, 0.9, seed=i)) for i, p in enumerate(PROMPTS[:3])]
    assert sample(3, companions=noisy).token_ids == first.token_ids  # independent of batch companions
    assert sample(4).token_ids != first.token_ids
    # top_p = 1: the log-prob at temperature T, untruncated
    torch.testing.assert_close(torch.tensor(first.logprobs), hf_logprobs(model, PROMPTS[1], first.token_ids, 0.7),
                               atol=1e-4, rtol=0)
    # top_p < 1: under the nucleus at temperature T, renormalised (what the token was drawn from)
    nucleus = sample(6, top_p=0.8, companions=noisy)
    reference = hf_nucleus_logprobs(model, PROMPTS[1], nucleus.token_ids, 0.7, 0.8)
    torch.testing.assert_close(torch.tensor(nucleus.logprobs), reference, atol=1e-4, rtol=0)
    untruncated = hf_logprobs(model, PROMPTS[1], nucleus.token_ids, 0.7)
    assert (reference - untruncated).abs().max() > 0.05  # the two differ on this sample
    nucleus_of_one = sample(5, top_p=1e-6)  # top-p keeps only the most likely token: probability 1
    assert nucleus_of_one.token_ids == hf_greedy(model, PROMPTS[1], 25)
    assert nucleus_of_one.logprobs == [0.0] * 25


def test_stats_count_steps_tokens_and_saturation(qwen):
    _, path = qwen
    engine = CPUEngine(path, slots=2)
    assert engine.stats()["saturated_tokens_per_s"] is None
    out = run(engine, [Request(f"r{i}", "p", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    s = engine.stats()
    assert s["generated_tokens"] == sum(c.num_tokens for c in out.values()) == 50
    assert s["active_slot_steps"] == 50 - len(PROMPTS)  # each request's first token comes from its prefill
    assert s["decode_steps"] >= 25 and s["busy_s"] > 0 and s["saturated_tokens_per_s"] > 0


def test_bad_requests_and_models_are_refused_with_the_field(tmp_path, qwen):
    _, path = qwen
    engine = CPUEngine(path, slots=1)
    with pytest.raises(ValueError, match=r"request x: prompt_ids\[1\]=64 is not a token id in \[0, 64\)"):
        engine.add(Request("x", "p", [1, 64], greedy()))
    with pytest.raises(ValueError, match="request y: resume_ids, resume_logprobs and resume_versions"):
        engine.add(Request("y", "p", [1], greedy(), resume_ids=[2], resume_logprobs=[]))
    with pytest.raises(ValueError, match="request z: params.top_p"):
        engine.add(Request("z", "p", [1], SamplingParams(top_p=0.0)))
    engine.add(Request("dup", "p", [1], greedy()))
    with pytest.raises(ValueError, match="request dup: request_id already in the engine"):
        engine.add(Request("dup", "p", [1], greedy()))
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json: model_type 'gpt2' is not supported"):
        CPUEngine(str(bad), slots=1)


LONG = [(7 * i) % 64 for i in range(150)]


def counting_attention(engine) -> list:
    """Record the key positions each attention call of the engine's model reads (sequences x keys)."""
    calls, attend = [], engine.model.attend

    def counted(q, keys, values, mask):
        calls.append(keys.shape[0] * keys.shape[2])
        return attend(q, keys, values, mask)
    engine.model.attend = counted
    return calls


def test_attention_work_follows_each_slots_own_length(qwen, monkeypatch):
    model, path = qwen
    layers = model.config.num_hidden_layers
    prompts = [LONG] + [PROMPTS[i % len(PROMPTS)] for i in range(7)]

    def generate():
        engine = CPUEngine(path, slots=8)
        calls = counting_attention(engine)
        for i, p in enumerate(prompts):
            engine.add(Request(f"r{i}", "p", p, greedy(12)))
        engine.step()  # the prefill, then the first decode
        work, out = [], {}
        for s in range(2, 12):  # decode step s reads each slot's prompt and s tokens (the last one new)
            calls.clear()
            out.update((c.request_id, c) for c in engine.step())
            own = sum(len(p) + s for p in prompts)
            work.append((sum(calls) / layers, own))
        assert not engine.has_work()
        return work, out

    work, out = generate()
    assert all(attended < 2 * own for attended, own in work)  # a power-of-two bucket: under twice one's own
    monkeypatch.setattr(builtin_engine, "length_spans", lambda lengths: [(0, len(lengths))])
    flat_work, flat = generate()
    assert [attended for attended, _ in flat_work] == [8 * (len(LONG) + s) for s in range(2, 12)]
    for rid, c in out.items():
        assert c.token_ids == flat[rid].token_ids
        # masked keys add exact zeros, but a different key count sums the softmax in another order
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(flat[rid].logprobs), atol=1e-5, rtol=0)
    assert out["r0"].token_ids == hf_greedy(model, LONG, 12)


def test_a_step_reads_the_device_once_through_fetch(qwen):
    """The engine on the meta device, where reading any tensor's value raises: a step may read only through
    `_fetch` (faked here), and once. A stray .item(), .tolist(), bool() or .nonzero() in a step fails."""
    _, path = qwen
    engine = CPUEngine(path, slots=3, eos_token_id=7, device="meta")
    fetches = []

    def fake_fetch(tokens, logprobs):
        n = tokens.shape[0]
        fetches.append(n)
        stop = len(fetches) == 1  # the first row of the first step samples EOS in its prefill
        return [7 if stop and i == 0 else 1 for i in range(n)], [-0.5] * n

    engine._fetch = fake_fetch
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=1)
    requests = [Request("eos", "p", PROMPTS[0], greedy(5)), Request("nucleus", "p", PROMPTS[1], sampled),
                Request("resumed", "p", PROMPTS[2], SamplingParams(6, 0.8), resume_ids=[3, 4],
                        resume_logprobs=[-1.0, -1.0], resume_versions=[0, 0]),
                Request("queued", "p", PROMPTS[3], greedy(2))]
    for r in requests:
        engine.add(r)
    out, per_step = {}, []
    while engine.has_work():
        before = len(fetches)
        out.update((c.request_id, c) for c in engine.step())
        per_step.append(len(fetches) - before)
    assert per_step == [1] * 5
    assert fetches[0] == 6  # three prefill tokens and three decode tokens, in one read
    assert out["eos"].token_ids == [7] and out["eos"].finish_reason == "stop"  # its decoded token dropped
    assert out["nucleus"].token_ids == [1] * 6 and out["resumed"].token_ids == [3, 4, 1, 1, 1, 1]
    assert out["queued"].token_ids == [1, 1] and out["queued"].slot == out["eos"].slot


def assert_near_float32_greedy(reference, prompt, completion, margin=0.25, atol=0.25):
    """Greedy tokens of a lower-precision engine against the float32 `reference` model, scored on the engine's
    own tokens (so one flipped near-tie does not derail the rest): each is the best token or within `margin`
    logits of it, and its log-prob within `atol`. bfloat16 keeps 8 significant bits: one rounding moves a logit
    of about 6 by up to 0.012, and a forward rounds weights, each layer's activations and the residual stream;
    0.11 was the largest log-prob difference seen on the tiny models. Most tokens must be the best one."""
    device = next(reference.parameters()).device
    tokens = torch.tensor(completion.token_ids, device=device)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + completion.token_ids], device=device)).logits[0, len(prompt) - 1:-1]
    chosen = logits.gather(1, tokens[:, None]).squeeze(1)
    assert (logits.max(-1).values - chosen).max() <= margin
    assert (chosen == logits.max(-1).values).float().mean() >= 0.9
    expected = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1).cpu()
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=atol, rtol=0)


def test_bfloat16_on_the_cpu_stays_within_its_rounding(qwen):
    model, path = qwen
    engine = CPUEngine(path, slots=8, dtype="bfloat16")
    assert engine.model.k_cache.dtype == engine.model.embed.dtype == torch.bfloat16
    out = run(engine, [Request(f"r{i}", "p", p, greedy()) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert_near_float32_greedy(model, prompt, out[f"r{i}"])


def test_device_and_dtype_come_from_the_rollout_config():
    from rlsys.config import ConfigError
    from rlsys.rollout.manager import engine_options, worker_gpus
    from rlsys.startup import load_config

    def options(*overrides):
        cfg = load_config(None, list(overrides))
        kwargs = engine_options(cfg)
        return kwargs.get("device"), kwargs["dtype"], worker_gpus(cfg.rollout.engine, kwargs)

    assert options() == ("cpu", "float32", 0)  # auto: the CPU keeps float32
    assert options("rollout.device=cuda", "cluster.gpus_per_node=1") == ("cuda", "bfloat16", 1)
    assert options("rollout.dtype=bfloat16") == ("cpu", "bfloat16", 0)
    assert options("rollout.engine=vllm") == (None, "bfloat16", 1)
    with pytest.raises(ConfigError, match="rollout.device"):
        load_config(None, ["rollout.device=tpu"])


def two_gpu_engine(model_dir, slots, **kwargs):
    raise AssertionError("never built here")


register_engine("two-gpu", options=lambda rollout: {"lanes": rollout.slots},
                gpus=lambda options: 2 * bool(options["lanes"]))(two_gpu_engine)


def test_an_engine_registry_entry_says_what_its_workers_take():
    """A registered engine's options and GPUs come from its entry, not from branches on engine names."""
    from rlsys.rollout.manager import engine_options, worker_gpus
    from rlsys.startup import load_config

    options = engine_options(load_config(None, ["rollout.engine=two-gpu", "rollout.slots=8"]))
    assert options["lanes"] == 8 and "device" not in options and worker_gpus("two-gpu", options) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_cuda_without_a_gpu_is_refused_naming_the_field(qwen, ray_cluster):
    from rlsys.rollout.manager import RolloutManager

    _, path = qwen
    with pytest.raises(ValueError, match="rollout.device=cuda: cpu engine sees no CUDA device"):
        CPUEngine(path, slots=1, device="cuda")
    with pytest.raises(ValueError, match=r"rollout.device=cuda: each rollout worker needs 1 GPU\(s\) and the Ray "
                                         "cluster has 0"):
        RolloutManager(path, 1, 2, engine_kwargs={"device": "cuda"})


def test_a_lying_sampler_draws_at_its_temperature_and_records_the_claimed_one(qwen, decode):
    """SamplingParams.logprob_temperature (the friction testbed): the tokens are those of temperature 2, the
    log-probs are those of temperature 0.7 for the same tokens."""
    model, path = qwen
    engine = CPUEngine(path, slots=4, decode=decode)
    honest = SamplingParams(max_new_tokens=25, temperature=2.0, seed=9)
    lying = SamplingParams(max_new_tokens=25, temperature=2.0, seed=9, logprob_temperature=0.7)
    beside = Request("g", "p", PROMPTS[0], greedy(10))  # a greedy row in the same batch keeps its own log-probs
    out = run(engine, [Request("honest", "p", PROMPTS[1], honest), Request("lying", "p", PROMPTS[1], lying), beside])
    assert out["lying"].token_ids == out["honest"].token_ids
    torch.testing.assert_close(torch.tensor(out["lying"].logprobs),
                               hf_logprobs(model, PROMPTS[1], out["lying"].token_ids, 0.7), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(out["honest"].logprobs),
                               hf_logprobs(model, PROMPTS[1], out["honest"].token_ids, 2.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(out["g"].logprobs), hf_logprobs(model, PROMPTS[0], out["g"].token_ids),
                               atol=1e-4, rtol=0)


# --- the step's memory traffic: views of the cache and its mask, never copies --------------------------------
def test_fragmented_slots_attend_through_views_of_the_cache_and_its_mask(qwen):
    """Slots of one length bucket scattered among others' (as requests finish out of order) read the KV cache
    and the mask kept beside it as views: no per-layer gather of the cache, no mask built per step."""
    model, path = qwen
    engine = CPUEngine(path, slots=6)
    seen = []
    attend = engine.model.attend

    def checked(q, keys, values, mask):
        seen.append(all(t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                        for t, base in ((keys, engine.model.k_cache), (values, engine.model.v_cache),
                                        (mask, engine.model.kv_mask))))
        return attend(q, keys, values, mask)
    engine.model.attend = checked
    # slots 0, 2, 4 long, 1, 3, 5 short: each bucket's slots are every other one
    prompts = [LONG if i % 2 == 0 else PROMPTS[i % 5] for i in range(6)]
    out = run(engine, [Request(f"r{i}", "p", p, greedy(10)) for i, p in enumerate(prompts)])
    assert seen and all(seen)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].token_ids == hf_greedy(model, p, 10), i


def test_a_fragmented_span_is_planned_once_a_step_not_once_a_layer(qwen):
    """Its rows' places and its query buffer are made once a step; each layer only copies its queries in and its
    outputs out (on a GPU every op is a launch the host pays for, and a run's slots are fragmented)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model, path = qwen
    layers = model.config.num_hidden_layers
    engine = CPUEngine(path, slots=6)
    for i in range(6):  # slots 0, 2, 4 long, 1, 3, 5 short: two spans, neither consecutive
        engine.add(Request(f"r{i}", "p", LONG if i % 2 == 0 else PROMPTS[i % 5], greedy(10)))
    engine.step()  # the prefill
    with Count() as count:
        engine.step()
    assert count.ops["index_copy_"] == count.ops["index_select"] == 2 * layers
    assert count.ops["sub"] == 2  # each span's places, once
    assert count.ops["zeros"] == 2 + 1 and "new_zeros" not in count.ops  # its query buffers, and the mask's zero


def test_recomputing_running_requests_builds_no_quadratic_mask(tmp_path):
    """A new version re-prefills every running request: its attention is causal over its own keys, without an
    n x G x T x T mask (18 GB at 64 slots of 4,224 tokens, G 8, in bf16)."""
    from test_weight_transfer import peak_new_bytes

    sizes = dict(SIZES, hidden_size=32, num_attention_heads=4, num_key_value_heads=1, intermediate_size=32,
                 max_position_embeddings=1024)
    _, path = build(tmp_path, sizes=sizes)
    engine = CPUEngine(str(path), slots=4)
    for i in range(4):
        engine.add(Request(f"r{i}", "p", [(5 * i + 3 * j) % 64 for j in range(1000)], greedy(8)))
    engine.step()
    n, G, T = 4, 4, 1000
    state = {name: t.clone() for name, t in engine.model.params.items()}
    peak = peak_new_bytes(lambda: engine.load_weights(state, 1))  # recompute: a re-prefill of all four
    assert peak < n * G * T * T * 4 / 4, peak


def test_attention_never_runs_on_cudnns_backend(qwen, monkeypatch):
    """cuDNN's attention builds a graph on the host for each new shape: 2.8 ms a call on an H100, and a decode
    step's key length is new every step (a 0.5B run's step took 90 ms instead of 15). Every attention call of a
    prefill and of the decode steps runs with that backend off; CUDA's flags are read the same on the CPU."""
    _, path = qwen
    sdpa, enabled = torch.nn.functional.scaled_dot_product_attention, []

    def checked(*args, **kwargs):
        enabled.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", checked)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # on by default: the engine turns it off for its own calls
    engine = CPUEngine(path, slots=4)
    out = run(engine, [Request(f"r{i}", "p", p, greedy(6)) for i, p in enumerate(PROMPTS[:4])])
    assert len(out) == 4 and len(enabled) >= 2 * 6 and not any(enabled)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and restores it


def test_engines_stepping_at_once_keep_cudnn_off_until_the_last_is_out(qwen, monkeypatch):
    """The backend flags are the process's, not a thread's. Engine a leaves its forward while b is inside its
    own: b's later attention calls still run without cuDNN, and the flag is back on once both are out (a
    per-forward sdpa_kernel turned it on under b, and b's exit then restored a's off for good)."""
    model, path = qwen
    a, b = CPUEngine(path, slots=1), CPUEngine(path, slots=1)
    sdpa, enabled = torch.nn.functional.scaled_dot_product_attention, {"a": [], "b": []}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def checked(*args, **kwargs):
        who = threading.current_thread().name
        enabled[who].append(torch.backends.cuda.cudnn_sdp_enabled())
        if len(enabled[who]) == 1:  # a's first call waits for b inside; b's first, for a out
            (a_in if who == "a" else b_in).set()
            assert (b_in if who == "a" else a_out).wait(10), who
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", checked)
    errors = []

    def step(engine, after: threading.Event | None, done: threading.Event | None):
        try:
            if after is not None:
                assert after.wait(10)
            engine.add(Request(threading.current_thread().name, "p", PROMPTS[0], greedy(2)))
            engine.step()
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(e)
        finally:
            if done is not None:
                done.set()
    threads = [threading.Thread(target=step, args=(a, None, a_out), name="a"),
               threading.Thread(target=step, args=(b, a_in, None), name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    layers = model.config.num_hidden_layers  # a step's forwards call attention once a layer each
    assert len(enabled["a"]) == len(enabled["b"]) >= layers >= 2 and not any(enabled["a"] + enabled["b"])
    assert torch.backends.cuda.cudnn_sdp_enabled()


# --- the static decode step and its CUDA graphs (graph_step.py) ---------------------------------------------
def test_shape_buckets_are_powers_of_two_then_steps_up_to_the_limit():
    assert buckets(64, 8) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets(20, 8) == (1, 2, 4, 8, 16, 20) and buckets(3, 8) == (1, 2, 3) and buckets(1, 8) == (1,)
    assert buckets(640, 128) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640)
    assert [bucket(n, buckets(20, 8)) for n in (1, 3, 8, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]


def test_a_static_step_takes_the_buckets_of_its_highest_slot_and_longest_keys(qwen):
    """Slots decode in slot order: one request left in slot 5 still runs a batch of 8 (the bucket of 6 slots);
    the key length is the smallest bucket holding its keys."""
    _, path = qwen
    engine = CPUEngine(path, slots=8, decode="static")
    shapes, step = [], engine._static_step
    engine._static_step = lambda B, K, mode: shapes.append((B, K)) or step(B, K, mode)
    short = [Request(f"s{i}", "p", PROMPTS[0], greedy(2)) for i in range(5)]
    out = run(engine, [*short, Request("long", "p", PROMPTS[4], greedy(70))])
    assert out["long"].slot == 5 and out["long"].token_ids == run(CPUEngine(path, slots=1), [
        Request("alone", "p", PROMPTS[4], greedy(70))])["alone"].token_ids
    keys = [len(PROMPTS[4]) + i for i in range(1, 70)]  # the long request's keys at each of its decode steps
    assert shapes == [(8, next(k for k in (16, 32, 64, 128) if k >= n)) for n in keys]


def mixed_workload() -> tuple[list[Request], dict]:
    """Greedy, sampled, nucleus and claimed-temperature requests of several lengths and length buckets, more
    than the slots: some join while others decode, and leave at different steps."""
    params = [greedy(30), SamplingParams(25, 1.0, 0.9, seed=1), SamplingParams(40, 0.7, seed=2), greedy(5),
              SamplingParams(12, 2.0, seed=3, logprob_temperature=0.7), SamplingParams(60, 1.0, 0.8, seed=4)]
    first = [Request(f"r{i}", "p", PROMPTS[i % 5] * (1 + i % 3), p) for i, p in enumerate(params)]
    late = [Request(f"late{i}", "p", PROMPTS[i], SamplingParams(20, 1.0, 0.95, seed=10 + i)) for i in range(3)]
    return first, {4: late[:2], 9: late[2:]}


def assert_same_completions(a: dict, b: dict) -> None:
    """Same tokens, slots and ends; log-probs within float32 rounding (the static step sums over masked padding
    keys and a padded batch, in other blocks than the eager step)."""
    assert sorted(a) == sorted(b)
    for rid in a:
        assert (b[rid].token_ids, b[rid].slot, b[rid].finish_reason) == (a[rid].token_ids, a[rid].slot,
                                                                          a[rid].finish_reason), rid
        torch.testing.assert_close(torch.tensor(b[rid].logprobs), torch.tensor(a[rid].logprobs), atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", ["static", "graph"])
def test_the_static_step_samples_what_the_eager_step_samples(qwen, monkeypatch, mode):
    _, path = qwen
    eager = run(CPUEngine(path, slots=4), *mixed_workload())
    if mode == "graph":
        graphs = FakeGraphs().install(monkeypatch)
        FakeDriver().install(monkeypatch)
    engine = CPUEngine(path, slots=4, decode=mode)
    assert_same_completions(eager, run(engine, *mixed_workload()))
    if mode == "graph":  # one capture per shape, in one pool; every other step a replay
        assert len(graphs.captured) == len(engine.graphs.graphs) == len(set(engine.graphs.graphs)) > 1
        assert set(graphs.captured) == {engine.graphs.pool}
        assert sum(g.replays for g in engine.graphs.graphs.values()) > 3 * len(graphs.captured)


def test_graphs_are_captured_again_after_the_kv_cache_is_reallocated(qwen, cuda_graphs):
    """A wake after sleep allocates a new KV cache: graphs over the old one would read and write it."""
    _, path = qwen
    eager = run(CPUEngine(path, slots=4), *mixed_workload())
    engine = CPUEngine(path, slots=4, decode="graph")
    assert_same_completions(eager, run(engine, *mixed_workload()))
    captures = len(cuda_graphs.captured)
    engine.sleep(1)
    assert engine.graphs.graphs == {} and engine.graphs.pool is None  # their memory goes with the cache
    engine.wake_up()
    assert_same_completions(eager, run(engine, *mixed_workload()))
    assert len(cuda_graphs.captured) == 2 * captures
    engine.model.allocate_kv_cache()  # any reallocation, not only a wake's
    assert_same_completions(eager, run(engine, *mixed_workload()))
    assert len(cuda_graphs.captured) == 3 * captures


def test_a_capture_refuses_a_read_from_the_device(cuda_graphs):
    """The stand-in refuses what a real capture refuses: no kernel runs while a graph is recorded."""
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=torch.cuda.graph_pool_handle()):
            torch.ones(2).sum().item()
    with pytest.raises(TypeError, match="capture_begin"):
        torch.cuda.graph(torch.cuda.CUDAGraph(), pool=7)


@pytest.mark.parametrize("mode", ["static", "graph"])
def test_a_conversation_continues_over_its_kept_cache_through_the_static_step(model_dir, tags, monkeypatch, mode):
    """Multi-turn: a turn ends at a tool call and holds its slot while the others decode (a static step writes
    its scratch column, not its cache), then continues after the answer exactly as through the eager step."""
    prompt, _, call_open, call_close, first_turn = tags
    if mode == "graph":
        FakeDriver().install(monkeypatch)
        FakeGraphs().install(monkeypatch)
    out = {}
    for decode in ("eager", mode):
        engine = CPUEngine(model_dir, 3, max_len=256, decode=decode)
        engine.use_tools(call_open, call_close, max_turns=1)
        others = [Request(f"o{i}", "p", prompt[i:], SamplingParams(70, 1.0, seed=20 + i)) for i in range(1, 3)]
        out[decode] = run_tools(engine, [Request("c", "p", prompt, sampled()), *others], tool=lambda text: ANSWER)
    assert len(out["eager"]["c"].turns) == 1 and len(out["eager"]["c"].token_ids) > first_turn + 5
    assert_same_completions(out["eager"], out[mode])
    for rid, c in out["eager"].items():
        assert out[mode][rid].mask == c.mask


def test_decode_is_eager_on_the_cpu_by_default_and_graphs_need_cuda(qwen):
    _, path = qwen
    engine = CPUEngine(path, slots=2)
    assert engine.decode == "eager" and not engine.step_inputs_host.is_pinned()
    with pytest.raises(ValueError, match="decode=graph: cpu engine captures CUDA graphs and sees no CUDA device"):
        CPUEngine(path, slots=1, decode="graph")
    with pytest.raises(ValueError, match="decode='fast': one of eager, static, graph"):
        CPUEngine(path, slots=1, decode="fast")
