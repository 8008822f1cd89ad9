"""The vLLM engine: the RolloutEngine interface on vLLM's v1 `LLMEngine`, one `step()` per worker step.

Checked against the source of vLLM 0.33.0 (release commit 4ba787ec9); the paths below are inside the
vLLM repository. vLLM is imported only when an engine is built, so this module imports without it.

Why `LLMEngine` stepped by the rollout worker's thread rather than `AsyncLLM`: both drive the same engine
core and output processor, so requests, DELTA streaming, abort and `collective_rpc` behave the same.
`AsyncLLM` always runs the engine core in a process of its own with a busy loop
(vllm/v1/engine/async_llm.py, `make_async_mp_client` in vllm/v1/engine/core_client.py), read through an
asyncio loop; the core keeps stepping while an update arrives, so generation must be paused around it
(`pause_generation`) or tokens matched to weight versions afterwards (`CompletionOutput.weight_versions`),
and every weight bucket crosses the process boundary. In this process (`InprocClient`,
vllm/v1/engine/core_client.py) a `step()` is one schedule + forward + sample, a weight update falls
exactly between two steps (the worker thread already orders submits, aborts and updates), the
single-GPU executor receives RPC arguments without a copy, and each step's occupancy is measured here.
What in-process stepping gives up, overlapping the host work with the GPU, async scheduling mostly wins
back; vLLM turns it on by default for this executor (vllm/config/vllm.py).

- Construction: `LLMEngine.from_engine_args` (vllm/v1/engine/llm_engine.py) runs the engine core in
  another process whenever VLLM_ENABLE_V1_MULTIPROCESSING is set, and it defaults to 1 (vllm/envs.py),
  so it is set to 0 here. EngineArgs fields: vllm/engine/arg_utils.py, documented in vllm/config/model.py
  (logprobs_mode, skip_tokenizer_init, enable_sleep_mode, max_model_len, seed) and
  vllm/config/parallel.py (distributed_executor_backend, worker_extension_cls).
- Requests go in as token ids (`TokensPrompt`, vllm/inputs/llm.py): prompt + resumed tokens, with
  max_tokens cut by the resumed length. vLLM refuses a prompt as long as max_model_len and stops a
  sequence there with "length" (vllm/v1/engine/input_processor.py `_validate_prompt_len`,
  vllm/v1/core/sched/utils.py `check_stop`): the rules of `check_request` and `resume_finish_reason`.
  vLLM suffixes request ids internally but aborts by, and reports, the id given
  (input_processor.py `assign_request_id`, vllm/v1/engine/output_processor.py).
- Stop rule: our EOS ids alone. vLLM adds the EOS ids of the model's generation_config.json to every
  request unless ignore_eos is set, whatever EngineArgs.generation_config says
  (vllm/sampling_params.py `update_from_generation_config`); ignore_eos touches nothing else, and
  stop_token_ids still stop, so the built-in engine's rule (read_eos_ids) holds here too.
- Outputs stream as deltas (RequestOutputKind.DELTA, vllm/sampling_params.py; `CompletionOutput` in
  vllm/outputs.py): each step's new tokens and their log-probs are appended here, tagged with the
  current version, so an abort returns the tokens so far. finish_reason is "stop", "length" or "abort"
  (vllm/v1/engine/__init__.py `FinishReason`).
- Log-probs: logprobs=0 returns the sampled token's, one {token id: Logprob} per token
  (vllm/logprobs.py); logprobs_mode "processed_logprobs" takes them after temperature and top-p
  (vllm/v1/sample/sampler.py), as the trainer scores them; a greedy request gets the plain log-softmax.
  vLLM accepts temperatures up to 2 only (vllm/sampling_params.py `_verify_args`).
- Weights: `load_weights`, and `receive_weights`: a transport whose receiver is not per worker (the object
  store) is received here and each bucket sent with the RPC; the others receive inside vLLM's workers
  (rollout/vllm_extension.py). After any update, weights.running_requests=recompute calls
  `reset_prefix_cache(reset_running_requests=True)` (only where requests are held, and not while the KV cache
  sleeps), which preempts running requests and drops output still
  in flight under the old weights (vllm/v1/core/sched/scheduler.py `reset_prefix_cache`,
  `_preempt_request`): they recompute their KV cache, and every later token carries the new version.
  `keep` calls it without: running requests go on over their old KV cache (their later tokens are counted
  in Completion.stale_kv_tokens), and vLLM resets the prefix cache only if no block is in use (the block
  pool's `reset_prefix_cache`), so a new request may still reuse a cached prefix of the old weights.
- Sleep (vllm/v1/engine/core.py `sleep`, `wake_up`; tags: vllm/v1/executor/abstract.py SLEEP_TAGS):
  level 1 moves the weights to CPU memory and drops the KV cache, level 2 drops both (the model's buffers,
  such as RoPE tables, are kept on the host and restored: vllm/v1/worker/gpu_worker.py `sleep`). Sleep
  pauses the scheduler in "abort" mode, aborting whatever it holds (the interface refuses to sleep with
  requests held), and resets the prefix cache; scheduling resumes once "weights" and "kv_cache" are both
  awake. Requests added meanwhile are queued.
- Seeds (vllm/v1/sample/ops/topk_topp_sampler.py `random_sample`): a batch's unseeded rows share one draw
  from the engine's generator (seeded by EngineArgs.seed), while each seeded row runs its own generator, a
  kernel per row per step: no request to vLLM carries a seed (the engine is registered with
  seeded_eval=False), so its sampled eval is not reproducible draw for draw; greedy eval is.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from rlsys.rollout.engine import EngineCounters, RolloutEngine, check_request, read_eos_ids, read_tokenizer
from rlsys.rollout.vllm_extension import EXTENSION
from rlsys.types import Completion, Request
from rlsys.weights.buckets import iter_buckets
from rlsys.weights.transfer import WeightUpdate

RPC_BUCKET_BYTES = 256 << 20  # object-store path: one RPC per bucket keeps each message bounded


@dataclass
class _Sample:
    request: Request
    submit_time: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    start_time: float = 0.0  # when its first new token came out
    kv_version: int = 0  # the oldest weights in its KV cache
    stale_kv_tokens: int = 0  # tokens sampled over KV from older weights
    mask: list[int] = field(default_factory=list)  # a conversation's: 1 per model token, 0 per tool token
    turns: list = field(default_factory=list)
    held: bool = False  # waiting on a tool: out of vLLM until its answer comes (then resubmitted)


class VLLMEngine(RolloutEngine):
    def __init__(self, model_dir: str, slots: int, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, enable_sleep_mode: bool = False, dtype: str = "bfloat16",
                 max_len: int | None = None, seed: int = 0, eos_token_id: int | None = None,
                 name: str = "vllm engine", running_requests: str = "recompute", **engine_args):
        # Forced, not defaulted: stepping, abort and weight updates rely on the engine core being in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError as e:
            raise ImportError("rollout.engine=vllm needs vLLM (pip install vllm) and a GPU; "
                              "rollout.engine=cpu runs anywhere") from e
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (got {slots})")
        # Unseeded requests draw from the engine's generator: one seed per engine (its name holds the worker
        # index), or engines with equal batches would draw equal noise for samples of one prompt.
        args = EngineArgs(model=model_dir, tensor_parallel_size=tensor_parallel_size,
                          distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
                          gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                          dtype=dtype, max_model_len=max_len, max_num_seqs=slots,
                          seed=zlib.crc32(f"{seed}:{name}".encode()),
                          logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                          worker_extension_cls=EXTENSION,
                          # a conversation's next turn is a new vLLM request on the ids so far: its earlier turns'
                          # KV comes from the prefix cache (unrun: vLLM is not installed where this was written)
                          **{"enable_prefix_caching": True, **engine_args})
        self.llm = LLMEngine.from_engine_args(args)
        self.name, self.slots, self.version = name, slots, 0
        self.running_requests = running_requests  # weights.running_requests: "recompute" or "keep"
        self.max_len = self.llm.model_config.max_model_len
        self.vocab = self.llm.model_config.get_vocab_size()
        path = Path(model_dir)  # EOS and text: the same rules as the built-in engine
        self.eos_ids = read_eos_ids(path, eos_token_id)
        self.tokenizer = read_tokenizer(path)
        self.samples: dict[str, _Sample] = {}  # every request vLLM holds, waiting or running
        self.finished_early: list[Completion] = []  # resumed requests with nothing left to generate
        self.counters = EngineCounters()

    # --- interface --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        rid, resumed = request.request_id, request.resume_ids
        if rid in self.samples:
            raise ValueError(f"request {rid}: request_id already in the engine")
        self.validate(request)
        sample = _Sample(request, time.time(), list(resumed), list(request.resume_logprobs),
                         list(request.resume_versions), kv_version=self.version, **self._conversation_so_far(request))
        reason = self._resume_reason(sample)
        if reason:
            self.finished_early.append(self._completion(sample, reason))
            return
        self.samples[rid] = sample
        if not sample.held:  # one cut while its tool ran waits for the call's answer (made again)
            self._submit(sample)

    def _submit(self, sample: _Sample) -> None:
        """Give vLLM the request's ids so far: the prompt, and a resumed or continued conversation's tokens."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        request, p = sample.request, sample.request.params
        # vLLM seeds each request's sampler afresh: a resumed seeded sample is reproducible, but not the
        # draw an uninterrupted run would have made.
        params = SamplingParams(n=1, max_tokens=p.max_new_tokens - len(sample.tokens), temperature=p.temperature,
                                top_p=p.top_p, seed=p.seed, logprobs=0, stop_token_ids=sorted(self.eos_ids),
                                ignore_eos=True,  # else the model's generation_config.json EOS ids stop it too
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        self.llm.add_request(request.request_id, TokensPrompt(prompt_token_ids=request.prompt_ids + sample.tokens),
                             params)

    def extend(self, request_id: str, at: int, ids: list[int], turn) -> None:
        sample = self._waiting_on(request_id, at)
        if sample is None:
            return
        if self._append_answer(sample, ids, turn):
            self.finished_early.append(self._completion(self.samples.pop(request_id), "length"))
        else:
            self._submit(sample)

    def _records(self):
        return self.samples.values()

    def _record_of(self, request_id: str):
        return self.samples.get(request_id)

    def step(self) -> list[Completion]:
        t0 = time.perf_counter()
        done, self.finished_early = self.finished_early, []
        active = new_tokens = 0
        now = time.time()
        for out in self.llm.step():
            sample = self.samples.get(out.request_id)
            if sample is None or sample.held:  # aborted (or held for a tool) after this step's outputs were made
                continue
            seq = out.outputs[0]
            tokens = list(seq.token_ids)
            if tokens:
                if seq.logprobs is None or len(seq.logprobs) != len(tokens):
                    raise RuntimeError(f"{self.name}: request {out.request_id} came back without a log-prob "
                                       "per token (SamplingParams.logprobs=0 was set)")
                for i, t in enumerate(tokens):  # one by one: a tool call may end inside the delta
                    sample.tokens.append(t)
                    sample.logprobs.append(seq.logprobs[i][t].logprob)
                    sample.versions.append(self.version)
                    sample.mask.append(1)
                    sample.stale_kv_tokens += sample.kv_version < self.version
                    reason = self._call_or_end(sample)
                    if reason or sample.held:  # the turn ends here: vLLM's request goes, the rest is dropped
                        self.llm.abort_request([out.request_id])
                        if reason:
                            done.append(self._completion(self.samples.pop(out.request_id), reason))
                        break
                sample.start_time = sample.start_time or now
                active, new_tokens = active + 1, new_tokens + len(tokens)
                if sample.held or out.request_id not in self.samples:
                    continue
            if out.finished:
                if seq.finish_reason not in ("stop", "length", "abort"):
                    raise RuntimeError(f"{self.name}: request {out.request_id} finished with "
                                       f"{seq.finish_reason!r} (expected stop, length or abort)")
                del self.samples[out.request_id]
                done.append(self._completion(sample, seq.finish_reason))
        self.counters.record(active, self.slots, new_tokens, time.perf_counter() - t0)
        return done

    def abort(self, request_ids: list[str]) -> list[Completion]:
        held = [rid for rid in request_ids if rid in self.samples]
        in_vllm = [rid for rid in held if not self.samples[rid].held]
        if in_vllm:
            self.llm.abort_request(in_vllm)
        return [self._completion(self.samples.pop(rid), "abort") for rid in held]

    def has_work(self) -> bool:
        return bool(self.samples or self.finished_early)

    def load(self) -> dict:
        running = sum(1 for s in self.samples.values() if s.start_time)
        return {"running": running, "waiting": len(self.samples) - running, "slots": self.slots}

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        self.refuse_older(version)
        for plan, flat in iter_buckets(state_dict, RPC_BUCKET_BYTES, dtype=self.llm.model_config.dtype):
            self.llm.collective_rpc("rlsys_load_bucket", args=(plan, flat))
        self._weights_changed(version)

    def validate(self, request: Request) -> None:
        check_request(request, self.vocab, self.max_len)
        if request.params.temperature > 2:  # vLLM refuses it with its own error type, not a ValueError
            raise ValueError(f"request {request.request_id}: params.temperature must be <= 2 on the vLLM engine "
                             f"(got {request.params.temperature})")

    # --- weights by bucket, and sleep (colocated placement: see RolloutEngine.sleep) ----------
    def init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str = "nccl",
                          timeout_s: float = 600.0) -> None:
        """Join trainer rank 0's weight group as ranks rank_offset .. rank_offset + TP - 1."""
        self.llm.collective_rpc("rlsys_init_weight_group",
                                args=(host, port, world_size, rank_offset, backend, timeout_s))

    def receive_weights(self, update: WeightUpdate) -> None:
        """Blocking: every worker loads the buckets, received here and sent with the RPC one at a time, or
        received by each worker itself (update.receiver.per_worker)."""
        self.refuse_older(update.version)
        if update.receiver.per_worker:
            self.llm.collective_rpc("rlsys_receive", args=(update, self.name))
        else:
            for plan, flat in update.packed(self.name):
                self.llm.collective_rpc("rlsys_load_bucket", args=(plan, flat))
        self._weights_changed(update.version)

    def _release(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _reclaim(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    # --- helpers ------------------------------------------------------------------------------
    def _weights_changed(self, version: int) -> None:
        # Cached prefixes hold old-weight keys and values: drop them; with "recompute", running requests
        # recompute theirs too (vLLM preempts them and keeps their tokens). Asleep without its KV cache (a
        # colocated engine loading a version), it has no cached prefix (sleep reset it) and nothing to preempt.
        recompute = self.running_requests == "recompute"
        if "kv_cache" not in self.asleep:
            self.llm.reset_prefix_cache(reset_running_requests=recompute and bool(self.samples))
        self.version = version
        if recompute:
            for sample in self.samples.values():
                sample.kv_version = version

    def _completion(self, sample: _Sample, reason: str) -> Completion:
        r = sample.request
        return Completion(r.request_id, r.prompt_uid, list(r.prompt_ids), sample.tokens, sample.logprobs,
                          sample.versions, reason, text=self._decode(sample.tokens), submit_time=sample.submit_time,
                          start_time=sample.start_time or time.time(), end_time=time.time(),
                          stale_kv_tokens=sample.stale_kv_tokens, **self._conversation_of(sample))
