"""A stand-in for vLLM's LLMEngine, so the vLLM engine's own code (rlsys/rollout/vllm_engine.py) runs where vLLM is
not installed: the few names it imports, and an engine that decodes with the transformers model of the directory
(greedy, or sampled at the request's temperature from its seed), one token per request per step, streaming deltas
as vLLM's RequestOutputKind.DELTA does.

Its prefix cache is exact-prefix bookkeeping: a request's `computed` tokens are those of its prompt past the longest
prefix of a sequence it held before (vLLM's caches whole blocks; the principle is the same), while
`enable_prefix_caching` is on and until `reset_prefix_cache`."""
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM


class EngineArgs:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class _Held:
    ids: list[int]  # prompt + generated so far
    params: SimpleNamespace
    generator: torch.Generator
    new: list[int] = field(default_factory=list)


class StandInLLM:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.model_config = SimpleNamespace(max_model_len=args.max_model_len or self.model.config.max_position_embeddings,
                                            get_vocab_size=lambda: self.model.config.vocab_size, dtype=torch.float32)
        self.held: dict[str, _Held] = {}
        self.seen: list[list[int]] = []  # sequences the prefix cache holds
        self.computed: list[tuple[str, int]] = []  # (request id, the prompt tokens it had to prefill), in order

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    def add_request(self, request_id, prompt, params):
        ids = list(prompt["prompt_token_ids"])
        cached = max((_common(ids, s) for s in self.seen), default=0) if self.args.enable_prefix_caching else 0
        self.computed.append((request_id, len(ids) - cached))
        self.held[request_id] = _Held(ids, params, torch.Generator().manual_seed(params.seed or 0))

    def abort_request(self, request_ids):
        for rid in request_ids:
            self._forget(rid)

    def reset_prefix_cache(self, reset_running_requests=False):
        self.seen = []
        return True

    def step(self):
        outputs = []
        for rid, h in list(self.held.items()):
            with torch.no_grad():
                logits = self.model(torch.tensor([h.ids])).logits[0, -1]
            t = h.params.temperature
            logp = (logits / (t or 1.0)).log_softmax(-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=h.generator)) if t else int(logp.argmax())
            h.ids.append(token)
            h.new.append(token)
            finished = len(h.new) >= h.params.max_tokens
            seq = SimpleNamespace(token_ids=[token], logprobs=[{token: SimpleNamespace(logprob=float(logp[token]))}],
                                  finish_reason="length" if finished else None)
            outputs.append(SimpleNamespace(request_id=rid, outputs=[seq], finished=finished))
            if finished:
                self._forget(rid)
        return outputs

    def _forget(self, rid):
        h = self.held.pop(rid, None)
        if h is not None:
            self.seen.append(h.ids)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def install(monkeypatch) -> None:
    """vllm, vllm.inputs and vllm.sampling_params, as far as the vLLM engine imports them, for one test."""
    vllm = types.ModuleType("vllm")
    vllm.EngineArgs, vllm.LLMEngine = EngineArgs, StandInLLM
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(DELTA="delta")
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sampling)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
