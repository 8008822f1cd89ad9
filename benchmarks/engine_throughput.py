"""Decode throughput of the built-in engine against transformers' `generate`, same model and workload.

The model is the default tiny model's architecture (rlsys.config.ModelConfig) with random weights,
or a Hugging Face directory given with --model.
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

With --device cuda only the decode step is timed, on a grid of running sequences (--sweep) by their
context length (--lengths; "skewed": one sequence at the longest length, the rest at the shortest), with
the bytes and FLOPs a step moves: a step that reads far more bytes than it computes FLOPs per byte the GPU
can do (about 300 bf16 FLOPs per HBM byte on an H100) is memory-bound, and its time hardly grows with the batch.

    python benchmarks/engine_throughput.py [--batch 32] [--new-tokens 96] [--threads 1] [--sweep 1,8,32,128,256]
    python benchmarks/engine_throughput.py --device cuda [--model DIR] [--sweep 1,8,32,128,256]
                                           [--lengths 128,1024,4096]

With --against REV (a git revision) the engine of that revision and this checkout's run the same waves,
each in a process of its own (two versions of rlsys cannot share one), alternately, wave by wave: "nothing
got slower" measured on one machine in one run (results/engine_before_after_cpu.json).

    python benchmarks/engine_throughput.py --against REV [--batch 32] [--new-tokens 96] [--repeats 9]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsys.config import ModelConfig, RolloutConfig
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.types import Request, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "engine_throughput.json"
ROOT = Path(__file__).resolve().parent.parent


def build_model(folder: Path, vocab: int, m: ModelConfig | None = None) -> Qwen2ForCausalLM:
    m = m or ModelConfig()
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


def timed_steps(engine: CPUEngine, prompts: list[list[int]], new_tokens: int, temperature: float,
                repeats: int) -> float:
    """Best mean wall time (ms) of a decode step with these prompts running, prefill excluded. Each step ends
    in the engine's one read of its tokens, so on a GPU the time is the device's too."""
    best = float("inf")
    for wave in range(repeats + 1):  # the first wave warms up
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i)
            engine.add(Request(f"{wave}-{i}", "sweep", prompt, params))
        engine.step()  # admits every request: the prefill, and the first decode (two tokens each)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        if wave:
            best = min(best, (time.perf_counter() - t) / (new_tokens - 2))
    return round(best * 1000, 3)


def decode_step_ms(model_dir: str, prompts: torch.Tensor, batch: int, new_tokens: int, temperature: float,
                   repeats: int) -> float:
    """Best wall time of one decode step with `batch` sequences running, prefill excluded."""
    engine = CPUEngine(model_dir, slots=batch)
    return timed_steps(engine, [prompts[i % len(prompts)].tolist() for i in range(batch)], new_tokens,
                       temperature, repeats)


def parameter_count(m) -> int:
    return sum(t.numel() for t in {t.data_ptr(): t for t in m.params.values()}.values())  # a tied lm_head once


def step_grid(model_dir: str, args) -> list[dict]:
    """Decode step time by running sequences (--sweep) and context length (--lengths), with the bytes a
    step reads (weights once, each sequence's keys and values) and the FLOPs it does per byte."""
    batches, lengths = [int(b) for b in args.sweep.split(",")], [int(n) for n in args.lengths.split(",")]
    steps = args.grid_steps
    engine = CPUEngine(model_dir, slots=max(batches), max_len=max(lengths) + steps + 1, dtype=args.dtype,
                       device=args.device, decode=args.decode, attention=args.attention)
    m = engine.model
    params = parameter_count(m)
    elt = m.embed.element_size()
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * elt
    gen = torch.Generator().manual_seed(0)
    shapes = [*lengths, "skewed"] if len(lengths) > 1 else lengths
    rows = []
    for b in batches:
        for shape in shapes:
            context = [shape] * b if shape != "skewed" else [max(lengths)] + [min(lengths)] * (b - 1)
            prompts = [torch.randint(0, m.vocab, (n,), generator=gen).tolist() for n in context]
            ms = timed_steps(engine, prompts, steps, args.temperature, args.repeats)
            keys = sum(context) + b * steps / 2  # on average over the timed steps
            read = params * elt + keys * kv_per_token
            flops = 2 * params * b + 4 * keys * m.heads * m.head_dim * m.layers
            rows.append({"batch": b, "context": shape, "step_ms": ms, "tokens_per_s": round(b / ms * 1000, 1),
                         "read_gb_per_s": round(read / ms / 1e6, 2), "flops_per_byte": round(flops / read, 2)})
            if args.gpu:
                cost = model_cost(m, params, args.gpu)
                rows[-1]["cost_model_ms"] = round(cost.step_s(b, keys) * 1000, 3)
            print(f"batch {b:4d} context {shape!s:>7s}: {ms:8.3f} ms/step, {rows[-1]['tokens_per_s']:10.0f} tokens/s, "
                  f"{rows[-1]['read_gb_per_s']:8.2f} GB/s read, {rows[-1]['flops_per_byte']:7.2f} FLOPs/byte"
                  + (f", cost model {rows[-1]['cost_model_ms']:.3f} ms" if args.gpu else ""))
    return rows


def model_cost(m, params: int, gpu: str):
    """rlsys.costs' vLLM decode and prefill cost for this model on `gpu`: what the simulator and the emulated
    clock assume."""
    from rlsys.costs import GPUS, EngineCost, ModelShape

    return EngineCost.build(ModelShape(params, m.layers, m.kv_heads, m.head_dim), GPUS[gpu], tp=1)


def prefill_grid(model_dir: str, args) -> list[dict]:
    """Time of one step that admits `batch` prompts of `length` tokens each (their prefill, one token each),
    against the cost model's prefill time for those tokens."""
    points = [tuple(map(int, p.split("x"))) for p in args.prefill.split(",")]
    engine = CPUEngine(model_dir, slots=max(b for b, _ in points), max_len=max(n for _, n in points) + 2,
                       dtype=args.dtype, device=args.device)
    m = engine.model
    params = parameter_count(m)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for b, n in points:
        best = float("inf")
        for rep in range(args.repeats + 1):  # the first warms up
            for i in range(b):
                ids = torch.randint(0, m.vocab, (n,), generator=gen).tolist()
                engine.add(Request(f"p{b}x{n}-{rep}-{i}", "prefill", ids, SamplingParams(max_new_tokens=1, seed=i)))
            t = time.perf_counter()
            engine.step()  # admit: the prefill, its token read back (the step's one sync)
            if rep:
                best = min(best, time.perf_counter() - t)
            assert not engine.has_work()
        row = {"batch": b, "length": n, "step_ms": round(best * 1000, 3),
               "prefill_tokens_per_s": round(b * n / best, 1)}
        if args.gpu:
            row["cost_model_ms"] = round(model_cost(m, params, args.gpu).prefill_s_per_token * b * n * 1000, 3)
        rows.append(row)
        print(f"prefill {b:3d} x {n:5d} tokens: {row['step_ms']:9.3f} ms, {row['prefill_tokens_per_s']:10.0f} tokens/s"
              + (f", cost model {row['cost_model_ms']:.3f} ms" if args.gpu else ""))
    return rows


def compare_with_generate(tmp: str, model, args) -> dict:
    """The engine against transformers' generate on the CPU, and the decode step time by batch."""
    B, N, P = args.batch, args.new_tokens, args.prompt_len
    prompts = bench_prompts(args)
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
    print(f"{'':24s}{'tokens/s':>12s}{'tokens/cpu-s':>14s}")
    for name, r in results.items():
        cpu_rate = r.get("tokens_per_cpu_s", r.get("run_tokens_per_cpu_s"))
        print(f"{name:24s}{r['tokens_per_s']:12.0f}{cpu_rate:14.0f}")
    print(f"engine speedup over generate (median of paired runs): {speedup['wall']}x wall, {speedup['cpu']}x cpu "
          f"(batch {B}, {N} new tokens, {args.threads} thread(s))")
    print("decode step (ms) by batch: " + ", ".join(f"{b}: {ms}" for b, ms in sweep.items()))
    return {"results": results, "engine_speedup_over_hf_generate": speedup, "decode_step_ms_by_batch": sweep}


def bench_prompts(args) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))


def serve(model_dir: str, args) -> None:
    """--serve: one contender of --against. Each line on stdin runs one wave of `batch` requests through one
    engine (built once) and answers its wall and CPU seconds."""
    engine, prompts = CPUEngine(model_dir, slots=args.batch), bench_prompts(args)
    for wave, _ in enumerate(sys.stdin):
        for i in range(args.batch):
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=i)
            engine.add(Request(f"{wave}-{i}", "bench", prompts[i].tolist(), params))
        wall, cpu = timed(lambda: [engine.step() for _ in iter(engine.has_work, False)])
        print(wall, cpu, flush=True)


def before_after(model_dir: str, args) -> dict:
    """This checkout's engine against revision `args.against`'s, wave by wave in turn (after a warm-up wave
    each): each one's best tokens per second, and the median of the paired ratios (checkout over revision)."""
    with tempfile.TemporaryDirectory() as old:
        subprocess.run(f"git archive {args.against} rlsys | tar -x -C {old}", shell=True, check=True, cwd=ROOT)
        command = [sys.executable, __file__, "--serve", model_dir, "--batch", str(args.batch), "--new-tokens",
                   str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--vocab", str(args.vocab),
                   "--threads", str(args.threads), "--temperature", str(args.temperature)]
        names = {args.against: old, "checkout": str(ROOT)}
        procs = {name: subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=root), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True) for name, root in names.items()}

        def wave(name: str) -> tuple[float, float]:
            procs[name].stdin.write("wave\n")
            procs[name].stdin.flush()
            wall, cpu = map(float, procs[name].stdout.readline().split())
            return wall, cpu

        runs = {name: [] for name in procs}
        for repeat in range(args.repeats + 1):
            for name in procs:
                timing = wave(name)
                if repeat:  # the first wave warms up
                    runs[name].append(timing)
        for p in procs.values():
            p.stdin.close()
            p.wait()
    tokens = args.batch * args.new_tokens
    before, after = runs[args.against], runs["checkout"]
    return {"against": args.against,
            "results": {name: {"tokens_per_s": round(tokens / min(w for w, _ in r), 1),
                               "tokens_per_cpu_s": round(tokens / min(c for _, c in r), 1),
                               "wall_s": [round(w, 4) for w, _ in r]} for name, r in runs.items()},
            "checkout_speed_over_revision": {
                "wall": round(statistics.median(b[0] / a[0] for b, a in zip(before, after)), 3),
                "cpu": round(statistics.median(b[1] / a[1] for b, a in zip(before, after)), 3)}}


def machine(args) -> dict:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    return {"device": device, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__}


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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the step grid only")
    ap.add_argument("--dtype", default="auto", help="as rollout.dtype (auto: float32 on the CPU, else bfloat16)")
    ap.add_argument("--decode", help="the engine's decode mode for the step grid (default: the engine's own)")
    ap.add_argument("--attention", help="the engine's decode attention for the step grid, sdpa or split_kv "
                    "(default: the engine's own)")
    ap.add_argument("--lengths", help="context lengths of the step grid (default on cuda: 128,1024,4096)")
    ap.add_argument("--grid-steps", type=int, default=16, help="decode steps timed per grid point")
    ap.add_argument("--model", help="a Hugging Face model directory for the step grid (default: the tiny model)")
    ap.add_argument("--config", type=Path, help="build the model from this rlsys config's model.* fields instead")
    ap.add_argument("--prefill", help="prefill points BATCHxLENGTH,... (cuda default: 1x128,1x1024,1x4096,8x1024,32x512)")
    ap.add_argument("--gpu", help="compare with rlsys.costs for this GPU (h100, h200, ...)")
    ap.add_argument("--out", type=Path, help="default: results/engine_throughput.json, or engine_decode_cuda.json")
    ap.add_argument("--against", help="a git revision: its engine against this checkout's, interleaved (CPU)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # a model directory: run as one contender of --against
    args = ap.parse_args()
    if args.serve:
        torch.set_num_threads(args.threads)
        return serve(args.serve, args)
    args.dtype = RolloutConfig(device=args.device, dtype=args.dtype).engine_dtype
    args.lengths = args.lengths or ("128,1024,4096" if args.device == "cuda" else None)
    args.prefill = args.prefill or ("1x128,1x1024,1x4096,8x1024,32x512" if args.device == "cuda" else None)
    model_cfg = ModelConfig(**{k: v for k, v in yaml.safe_load(args.config.read_text())["model"].items()
                               if k != "warm_start"}) if args.config else ModelConfig()
    out = args.out or (RESULTS.with_name("engine_before_after_cpu.json") if args.against else
                       RESULTS if args.device == "cpu" else RESULTS.with_name(f"engine_decode_{args.device}.json"))
    load_before = os.getloadavg()[0]  # other processes' load skews wall times: recorded with the results
    torch.set_num_threads(args.threads)
    report = {"command": "python benchmarks/engine_throughput.py " + " ".join(sys.argv[1:]),
              "machine": machine(args),
              "settings": {"batch": args.batch, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                           "vocab": args.vocab, "torch_threads": args.threads, "temperature": args.temperature,
                           "repeats": args.repeats, "device": args.device, "dtype": args.dtype,
                           "lengths": args.lengths, "grid_steps": args.grid_steps, "prefill": args.prefill,
                           "cost_model_gpu": args.gpu, "decode": args.decode or "default",
                           "attention": args.attention or "default", "model": args.model or
                           model_cfg.model_dump(include={"hidden_size", "num_layers", "num_heads",
                                                         "num_kv_heads", "intermediate_size"})}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab, model_cfg)
        if args.against:
            report.update(before_after(tmp, args))
            args.lengths = args.prefill = None
        elif args.device == "cpu":
            report.update(compare_with_generate(tmp, model, args))
        del model  # the engines load their own copy
        if args.lengths:
            report["decode_step_grid"] = step_grid(args.model or tmp, args)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")  # kept if the prefill grid is cut off
        if args.prefill:
            report["prefill_grid"] = prefill_grid(args.model or tmp, args)
    report["machine"]["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
