"""LoRA's trainer beside full fine-tuning (issue 51): trainable parameters, optimizer state, peak memory and step
time of the same model trained on the same batches, through the DeepSpeed backend the live trainer runs (ZeRO-2,
one rank, gloo on the CPU), on this machine's CPU.

    python benchmarks/lora_vs_full.py --out benchmarks/results/lora_vs_full_cpu.json

Memory: each mode in its own fresh process, built and stepped twice; its trainer's peak is the RSS high-water
beyond the one before the trainer was built (imports, the batch), so that mode's alone. Time:
one process holding both trainers, their steps interleaved (full, LoRA, full, ...) after a warm-up step each,
so a shared machine's load hits both alike; wall and CPU seconds of each step (CPU time, all threads, is less
at the mercy of other processes), the ratios the medians of the per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlsys.bench import machine, write_report  # noqa: E402

MODES = ("full", "lora")
LORA = {"rank": 16, "alpha": 32.0}  # configs/recipes/lora_grpo.yaml's adapters, on every projection


def build_model(folder: str, args) -> None:
    """A random Qwen2 of the bench presets' width (configs/gpu/bench_0.5b.yaml) with --layers layers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=args.vocab, hidden_size=1024, num_hidden_layers=args.layers,
                                 num_attention_heads=16, num_key_value_heads=2, intermediate_size=5632,
                                 max_position_embeddings=256)).save_pretrained(folder)


def batch(seed: int, args) -> list:
    """A step's samples: --prompts prompts x 4 responses of random tokens, lengths varying, 0/1 rewards."""
    from rlsys.trainer.batching import build_samples
    from rlsys.types import Completion, Group, Prompt, ScoredSample

    rng = random.Random(seed)
    groups = []
    for p in range(args.prompts):
        prompt = [rng.randrange(3, args.vocab) for _ in range(16)]
        samples = []
        for i in range(4):
            response = [rng.randrange(3, args.vocab) for _ in range(rng.randint(args.response // 2, args.response))]
            completion = Completion(f"{seed}-{p}-{i}", f"p{p}", prompt, response, [-5.5] * len(response),
                                    [0] * len(response), "stop")
            samples.append(ScoredSample(completion, float(i % 2)))
        groups.append(Group(Prompt(f"p{p}", "", ""), samples))
    return build_samples(groups, "grpo")


def trainer(mode: str, model_dir: str):
    from rlsys.config import TrainerConfig
    from rlsys.trainer.deepspeed_backend import DeepSpeedBackend
    from rlsys.trainer.logprobs import Scoring

    cfg = TrainerConfig(backend="deepspeed", zero_stage=2, loss="grpo", advantage="grpo",
                        lora=LORA if mode == "lora" else {})
    return DeepSpeedBackend(cfg, model_dir, Scoring())


def step(backend, samples) -> tuple[float, float]:
    """Wall and CPU seconds of one optimizer step on `samples`."""
    from rlsys.trainer.batching import plan_step

    wall, cpu = time.perf_counter(), time.process_time()
    backend.train_step(samples, plan_step(samples, 1, backend.cfg.micro_batch_tokens)[1])
    return time.perf_counter() - wall, time.process_time() - cpu


def state_bytes(backend) -> dict:
    """Parameters the optimizer steps, and the bytes of its state: AdamW's moments, and ZeRO's fp32 master copy of
    the trained parameters (its partition: all of it on one rank)."""
    import torch

    trained = [p for p in backend.engine.module.parameters() if p.requires_grad]
    moments = sum(t.numel() * t.element_size() for s in backend.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)
    master = sum(t.numel() * t.element_size() for t in backend.engine.optimizer.single_partition_of_fp32_groups)
    return {"trainable_parameters": sum(p.numel() for p in trained),
            "all_parameters": sum(p.numel() for p in backend.engine.module.parameters()),
            "adam_moment_bytes": moments, "fp32_master_bytes": master, "optimizer_state_bytes": moments + master}


def rank_env() -> None:
    """The variables the trainer worker sets for rank 0 of 1 (DeepSpeed starts gloo on them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def memory_child(mode: str, model_dir: str, args) -> dict:
    """One mode in this fresh process: RSS high-water before the trainer, after building it, after two steps."""
    import torch

    torch.set_num_threads(args.threads)
    rank_env()
    samples = batch(0, args)
    before = rss_mib()
    backend = trainer(mode, model_dir)
    built = rss_mib()
    for seed in (0, 1):
        step(backend, batch(seed, args))
    peak = rss_mib()
    return {**state_bytes(backend), "peak_rss_mib_before_trainer": round(before, 1),
            "peak_rss_mib_after_build": round(built, 1), "peak_rss_mib_after_2_steps": round(peak, 1),
            "trainer_peak_mib": round(peak - before, 1), "tokens_per_step": sum(s.num_tokens for s in samples)}


def timed(model_dir: str, args) -> dict:
    """Both trainers in this process, their steps interleaved round by round on the same batches."""
    import torch

    torch.set_num_threads(args.threads)
    rank_env()
    backends = {mode: trainer(mode, model_dir) for mode in MODES}
    for backend in backends.values():
        step(backend, batch(0, args))  # warm-up
    out = {}
    for clock in ("wall", "cpu"):
        out[f"{clock}_s"] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        samples = batch(1 + r, args)
        for mode in MODES:
            wall, cpu = step(backends[mode], samples)
            out["wall_s"][mode].append(round(wall, 3))
            out["cpu_s"][mode].append(round(cpu, 3))
            print(f"round {r}: {mode} {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr, flush=True)
    for clock in ("wall", "cpu"):
        seconds = out[f"{clock}_s"]
        ratios = [f / lo for f, lo in zip(seconds["full"], seconds["lora"])]
        out[f"median_{clock}_s"] = {m: statistics.median(s) for m, s in seconds.items()}
        out[f"full_over_lora_{clock}"] = {"median": round(statistics.median(ratios), 2),
                                          "per_round": [round(x, 2) for x in ratios]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/lora_vs_full_cpu.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=259)  # the character tokenizer's, as the bench presets
    ap.add_argument("--prompts", type=int, default=2, help="prompts a step, 4 responses each")
    ap.add_argument("--response", type=int, default=48, help="longest response (tokens); the shortest is half")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(memory_child(args.child, args.model_dir, args)))
        return
    report = {"command": "python benchmarks/lora_vs_full.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "what": "CPU: DeepSpeed ZeRO-2, one rank (gloo), float32; full fine-tuning vs LoRA (rank 16, alpha 32, "
                      "every attention and MLP projection) on the same random Qwen2 (hidden 1024, intermediate "
                      "5632, 16 heads, 2 KV heads) and the same batches; no KL term (no reference model) in either",
              "settings": {k: v for k, v in vars(args).items() if k not in ("child", "model_dir", "out")},
              "lora": LORA}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, args)
        report["memory"] = {}
        for mode in MODES:  # each in a fresh process: its own peak
            flags = [f"--{k}={v}" for k, v in report["settings"].items()]
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--model-dir", tmp, *flags],
                                 check=True, capture_output=True, text=True).stdout
            report["memory"][mode] = json.loads(out.strip().splitlines()[-1])
            print(f"{mode}: {report['memory'][mode]}", file=sys.stderr, flush=True)
            write_report(args.out, report)
        report["time"] = timed(tmp, args)
    m = report["memory"]
    report["full_over_lora"] = {
        "optimizer_state_bytes": round(m["full"]["optimizer_state_bytes"] / m["lora"]["optimizer_state_bytes"], 1),
        "peak_rss": round(m["full"]["peak_rss_mib_after_2_steps"] / m["lora"]["peak_rss_mib_after_2_steps"], 2),
        "trainer_peak": round(m["full"]["trainer_peak_mib"] / m["lora"]["trainer_peak_mib"], 2),
        "step_wall_time": report["time"]["full_over_lora_wall"]["median"],
        "step_cpu_time": report["time"]["full_over_lora_cpu"]["median"]}
    write_report(args.out, report)
    print(json.dumps(report["full_over_lora"]))


if __name__ == "__main__":
    main()
