"""Token log-probs from the LM head chunk by chunk (rlsys/trainer/logprobs.py): the same values and gradients
as a plain full-logits computation, top-p nucleus scoring as the engines record it, and bounded memory."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlsys.trainer.logprobs import Scoring, head_logprobs

VOCAB, HIDDEN = 50, 16


def plain_scores(hidden, weight, input_ids, temperature, top_p):
    """The straightforward way: full fp32 logits, the nucleus by sorting (the target always kept), log-softmax."""
    logits = (hidden[:, :-1] @ weight.T).float() / temperature
    targets = input_ids[:, 1:, None]
    if top_p < 1:
        probs = logits.softmax(-1)
        ranked, order = probs.sort(-1, descending=True)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, ranked.cumsum(-1) - ranked < top_p)
        logits = logits.masked_fill(~keep.scatter(-1, targets, True), float("-inf"))
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logp.gather(-1, targets).squeeze(-1), entropy


class Head(torch.nn.Linear):
    def __init__(self, weight):
        super().__init__(HIDDEN, VOCAB, bias=False)
        self.weight = torch.nn.Parameter(weight.clone())


@pytest.mark.parametrize("with_entropy", [False, True])  # a loss without and with an entropy term
@pytest.mark.parametrize("temperature, top_p, chunk", [(1.0, 1.0, 7), (0.7, 1.0, 1000), (0.7, 0.6, 5), (1.3, 0.9, 3)])
def test_chunked_head_matches_full_logits_in_values_and_gradients(temperature, top_p, chunk, with_entropy):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    input_ids = torch.randint(0, VOCAB, (3, 11))
    upstream = torch.randn(3, 10)  # a loss that weighs tokens differently
    entropy_upstream = torch.randn(3, 10) if with_entropy else torch.zeros(3, 10)

    def loss(logprobs, entropy):
        return (logprobs * upstream).sum() + ((entropy * entropy_upstream).sum() if with_entropy else 0.0)

    want, want_entropy = plain_scores(hidden, weight, input_ids, temperature, top_p)
    want_grads = torch.autograd.grad(loss(want, want_entropy), [hidden, weight])
    head = Head(weight.detach())
    mine = hidden.detach().requires_grad_(True)
    got, entropy = head_logprobs(mine, head, input_ids, Scoring(temperature, top_p), chunk)
    loss(got, entropy).backward()

    assert torch.allclose(got, want, atol=1e-5) and torch.isfinite(got).all()
    assert torch.allclose(entropy, want_entropy, atol=1e-5)
    assert torch.allclose(mine.grad, want_grads[0], atol=1e-5)
    assert torch.allclose(head.weight.grad, want_grads[1], atol=1e-5)


def test_top_p_scores_in_the_nucleus_and_never_gives_minus_infinity():
    torch.manual_seed(1)
    hidden, weight = torch.randn(1, 200, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids = torch.randint(0, VOCAB, (1, 200))
    got, _ = head_logprobs(hidden, Head(weight), input_ids, Scoring(0.8, 0.5), 64)
    full, _ = head_logprobs(hidden, Head(weight), input_ids, Scoring(0.8, 1.0), 64)
    # vLLM's processed log-probs: log-softmax over the nucleus, -inf outside it
    logits = (hidden[0, :-1] @ weight.T) / 0.8
    ranked, order = logits.softmax(-1).sort(-1, descending=True)
    inside = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, ranked.cumsum(-1) - ranked < 0.5)
    engine = logits.masked_fill(~inside, float("-inf")).log_softmax(-1).gather(-1, input_ids[0, 1:, None])[:, 0]
    sampled = engine.isfinite()  # tokens an engine could have sampled
    assert 0 < sampled.sum() < len(sampled)  # both kinds are present
    assert torch.allclose(got[0, sampled], engine[sampled], atol=1e-5)
    assert (got[0, sampled] > full[0, sampled]).all()  # renormalised over less mass
    assert torch.isfinite(got).all()


def test_top_p_one_and_temperature_zero_are_the_plain_softmax():
    torch.manual_seed(2)
    hidden, weight = torch.randn(2, 9, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids = torch.randint(0, VOCAB, (2, 9))
    got, _ = head_logprobs(hidden, Head(weight), input_ids, Scoring(0.0, 1.0), 4)
    want = (hidden[:, :-1] @ weight.T).log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5)


# --- memory: a subprocess per way of scoring, peak RSS above what the model itself needs ---------------
PEAK_SCRIPT = textwrap.dedent("""
    import json, sys

    def status_kb(field):  # VmRSS: resident now; VmHWM: its peak since the last reset
        line = next(l for l in open('/proc/self/status') if l.startswith(field))
        return int(line.split()[1])
    from types import SimpleNamespace as MicroBatch  # scoring reads input_ids and attention_mask only
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from rlsys.trainer.backend import scored_forward
    from rlsys.trainer.logprobs import Scoring, token_logprobs

    torch.set_num_threads(1)
    way, vocab, tokens, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, vocab, (1, tokens))
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids))

    def run(ids, mb):
        if way == "full":  # the logits, their fp32 copy and a softmax, whole
            logprobs, entropy = token_logprobs(model(input_ids=ids).logits, ids, Scoring(0.7), True)
        else:
            logprobs, entropy = scored_forward(model, mb, Scoring(0.7, 1.0), chunk)
        logprobs.sum().backward()

    run(ids[:, :8], MicroBatch(input_ids=ids[:, :8], attention_mask=mb.attention_mask[:, :8]))  # warm up
    model.zero_grad(set_to_none=False)
    open('/proc/self/clear_refs', 'w').write('5')  # reset the peak, so earlier peaks cannot hide this one
    before = status_kb('VmRSS')
    run(ids, mb)
    print(json.dumps({"extra_mb": (status_kb('VmHWM') - before) / 1024}))
""")


def peak_extra_mb(way: str, vocab: int, tokens: int, chunk: int) -> float:
    # A fixed mmap threshold makes glibc give every large tensor back when it is freed, so peak RSS follows
    # the tensors alive at once (by default, freed [chunk, vocab] blocks fragment the heap and RSS only grows).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, way, str(vocab), str(tokens), str(chunk)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]


def test_chunking_bounds_the_peak_memory_of_scoring():
    vocab, tokens, chunk = 65536, 512, 32
    logits_mb = tokens * vocab * 4 / 2**20  # one fp32 copy of the full logits: 128 MB
    full = peak_extra_mb("full", vocab, tokens, chunk)
    chunked = peak_extra_mb("chunked", vocab, tokens, chunk)
    print(f"peak extra memory, {tokens} tokens x {vocab} vocabulary: full logits {full:.0f} MB, "
          f"chunks of {chunk} tokens {chunked:.0f} MB")
    assert full > logits_mb  # the measurement sees the full logits (255-625 MB measured)
    assert chunked < logits_mb / 2 and chunked < full / 10
