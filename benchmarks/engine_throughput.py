"""Decode throughput of the built-in CPU engine against transformers' `generate`, same model and workload.

The model is the default tiny model's architecture (rlsys.config.ModelConfig) with random weights.
Three figures, in generated tokens per second:
  hf_generate        model.generate on a batch of B prompts, N new tokens each
  cpu_engine_wave    the same B requests through a CPUEngine with B slots
  cpu_engine_saturated  the engine's own saturated figure (steps with every slot busy) over a
                     continuous-batching run of 4B requests
And the time of one decode step against the batch (`--sweep`): on a CPU it grows with the batch, so a
half-empty engine costs about half as much per step; on a GPU's memory-bound decode it hardly grows,
so idle slots are time lost. That is why bubbles and stragglers cost little here (README: Performance).
Wall time is what matters; CPU time (process_time) is reported too because a shared machine's
wall time is noisy. The two contenders run alternately (--repeats times each); the speedup is the
median over those paired runs.

    python benchmarks/engine_throughput.py [--batch 32] [--new-tokens 96] [--threads 1] [--sweep 1,8,32,128,256]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsys.config import ModelConfig
from rlsys.rollout.cpu_engine import CPUEngine
from rlsys.types import Request, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "engine_throughput.json"


def build_model(folder: Path, vocab: int) -> Qwen2ForCausalLM:
    m = ModelConfig()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings))
    model.eval().save_pretrained(folder)
    return model


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(fns: dict, repeats: int, tokens: int) -> tuple[dict, dict]:
    """Alternate the contenders run by run, so a shared machine's load hits both alike. Returns each
    one's best rates, and the median of the per-run speedup of the second over the first."""
    for fn in fns.values():
        fn()  # warm-up
    runs: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(timed(fn))
    results = {name: {"tokens_per_s": round(tokens / min(w for w, _ in r), 1),
                      "tokens_per_cpu_s": round(tokens / min(c for _, c in r), 1),
                      "wall_s": [round(w, 4) for w, _ in r]} for name, r in runs.items()}
    base, other = runs.values()
    speedup = {"wall": round(statistics.median(b[0] / o[0] for b, o in zip(base, other)), 2),
               "cpu": round(statistics.median(b[1] / o[1] for b, o in zip(base, other)), 2)}
    return results, speedup


def decode_step_ms(model_dir: str, prompts: torch.Tensor, batch: int, new_tokens: int, temperature: float,
                   repeats: int) -> float:
    """Best wall time of one decode step with `batch` sequences running, prefill excluded."""
    engine = CPUEngine(model_dir, slots=batch)
    best = float("inf")
    for wave in range(repeats + 1):  # the first wave warms up
        for i in range(batch):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i)
            engine.add(Request(f"{wave}-{i}", "sweep", prompts[i % len(prompts)].tolist(), params))
        engine.step()  # admits every request: the prefill
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        if wave:
            best = min(best, (time.perf_counter() - t) / (new_tokens - 1))
    return round(best * 1000, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", default="1,8,32,128,256", help="batch sizes for the decode step time")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]  # other processes' load skews wall times: recorded with the results
    torch.set_num_threads(args.threads)
    B, N, P = args.batch, args.new_tokens, args.prompt_len
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (B, P), generator=gen)

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab)
        engine = CPUEngine(tmp, slots=B)
        sweep = {b: decode_step_ms(tmp, prompts, b, N, args.temperature, args.repeats)
                 for b in map(int, args.sweep.split(","))}

    sample = args.temperature > 0
    hf_kwargs = dict(max_new_tokens=N, min_new_tokens=N, do_sample=sample, pad_token_id=0)
    if sample:
        hf_kwargs.update(temperature=args.temperature, top_p=1.0, top_k=0)

    def hf():
        with torch.inference_mode():
            out = model.generate(prompts, **hf_kwargs)
        assert out.shape == (B, P + N)

    wave_id = [0]

    def run_engine(n_requests: int):
        wave_id[0] += 1
        for i in range(n_requests):
            params = SamplingParams(max_new_tokens=N, temperature=args.temperature, seed=i)
            engine.add(Request(f"{wave_id[0]}-{i}", "bench", prompts[i % B].tolist(), params))
        done = 0
        while engine.has_work():
            done += sum(c.num_tokens for c in engine.step())
        assert done == n_requests * N

    results, speedup = interleaved({"hf_generate": hf, "cpu_engine_wave": lambda: run_engine(B)},
                                   args.repeats, B * N)
    engine.counters.saturated_tokens, engine.counters.saturated_s = 0, 0.0  # saturation on the long run only
    wall, cpu = timed(lambda: run_engine(4 * B))
    results["cpu_engine_saturated"] = {
        "tokens_per_s": round(engine.stats()["saturated_tokens_per_s"], 1),
        "run_tokens_per_s": round(4 * B * N / wall, 1), "run_tokens_per_cpu_s": round(4 * B * N / cpu, 1)}

    report = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "settings": {"batch": B, "new_tokens": N, "prompt_len": P, "vocab": args.vocab,
                     "torch_threads": args.threads, "temperature": args.temperature, "repeats": args.repeats,
                     "model": ModelConfig().model_dump(include={"hidden_size", "num_layers", "num_heads",
                                                                "num_kv_heads", "intermediate_size"})},
        "results": results,
        "engine_speedup_over_hf_generate": speedup,
        "decode_step_ms_by_batch": sweep,
    }
    print(f"{'':24s}{'tokens/s':>12s}{'tokens/cpu-s':>14s}")
    for name, r in results.items():
        wall_rate = r["tokens_per_s"]
        cpu_rate = r.get("tokens_per_cpu_s", r.get("run_tokens_per_cpu_s"))
        print(f"{name:24s}{wall_rate:12.0f}{cpu_rate:14.0f}")
    print(f"engine speedup over generate (median of paired runs): {speedup['wall']}x wall, {speedup['cpu']}x cpu "
          f"(batch {B}, {N} new tokens, {args.threads} thread(s), load average {load_before:.1f})")
    print("decode step (ms) by batch: " + ", ".join(f"{b}: {ms}" for b, ms in sweep.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
