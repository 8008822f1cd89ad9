"""Where the built-in engine's decode step goes slower inside a run than alone: the same requests through the
engine in this process, through a RolloutWorker's generation thread here, and through a RolloutWorker as a
Ray actor on the GPU, alone, beside a second actor that holds a CUDA context and memory on the same GPU
(a colocated trainer rank between its steps), and after a sleep and wake (a colocated run's engine, each step).
Per mode: the wall time per decode step seen from outside and the engine's own busy time per step (busy_s /
decode_steps); a gap between the two is time the generation thread waits, a slow busy time is the step itself.
A run logs the same two figures per step: rollout/decode_step_ms and rollout/engine_busy_share.

    python benchmarks/gpu/live_engine.py --config configs/gpu/bench_0.5b.yaml [--requests 64] [--tokens 128]
        [--max-len 4224]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_throughput import build_model  # noqa: E402
from rlsys.config import ModelConfig  # noqa: E402
from rlsys.rollout.builtin_engine import CPUEngine  # noqa: E402
from rlsys.rollout.worker import RemoteRolloutWorker, RolloutWorker  # noqa: E402
from rlsys.types import Request, SamplingParams  # noqa: E402


def requests(n: int, tokens: int, vocab: int, tag: str, warm: bool = False) -> list[Request]:
    """The warm-up's are half as many: none of its shapes comes again in the measured pass, as in a run, where a
    backend that caches work per shape (cuDNN's attention graphs) gains nothing from it."""
    n = n // 2 if warm else n
    g = torch.Generator().manual_seed(0)
    return [Request(f"{tag}-{i}", "live", torch.randint(3, vocab, (32,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i)) for i in range(n)]


def per_step(wall: float, stats: dict) -> dict:
    steps = max(stats["decode_steps"], 1)
    return {"wall_ms_per_step": round(wall / steps * 1000, 2), "busy_ms_per_step": round(stats["busy_s"] / steps * 1000, 2),
            "decode_steps": stats["decode_steps"], "tokens": stats["generated_tokens"]}


def in_process(model_dir, args, kwargs) -> dict:
    engine = CPUEngine(model_dir, slots=args.requests, **kwargs)
    for warm in (True, False):
        before = dict(engine.stats())
        for r in requests(args.requests, args.tokens, args.vocab, f"e{warm}", warm):
            engine.add(r)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - t
    after = engine.stats()
    return per_step(wall, {k: after[k] - before[k] for k in ("decode_steps", "busy_s", "generated_tokens")})


def through_worker(worker, remote: bool, args) -> dict:
    def call(method: str, *a):
        if remote:
            import ray

            return ray.get(getattr(worker, method).remote(*a))
        return getattr(worker, method)(*a)

    for warm in (True, False):
        before = call("stats")
        batch = requests(args.requests, args.tokens, args.vocab, f"w{warm}", warm)
        t = time.perf_counter()
        call("submit", batch)
        done = 0
        while done < len(batch):
            done += len(call("drain", 1.0, args.handoff_s))
        wall = time.perf_counter() - t
    after = call("stats")
    return per_step(wall, {k: after[k] - before[k] for k in ("decode_steps", "busy_s", "generated_tokens")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=259)
    ap.add_argument("--handoff-s", type=float, default=0.05, help="as rollout.handoff_s")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script, no GPU figures")
    ap.add_argument("--max-len", type=int, default=None,
                    help="the KV cache's positions per slot; default prompt + tokens + 1. A run sizes it to "
                         "data.max_prompt_tokens + rollout.max_new_tokens (4224 for bench_0.5b.yaml)")
    args = ap.parse_args()
    m = ModelConfig(**{k: v for k, v in yaml.safe_load(args.config.read_text())["model"].items() if k != "warm_start"})
    gpu = 0.5 if args.device == "cuda" else 0  # the engine's and its peer's shares of the one GPU
    kwargs = dict(device=args.device, dtype="bfloat16" if gpu else "float32", max_len=args.max_len or 32 + args.tokens + 1)
    report = {"gpu": torch.cuda.get_device_name(0) if gpu else "none", "torch": torch.__version__, "requests": args.requests,
              "tokens": args.tokens, "max_len": kwargs["max_len"], "handoff_s": args.handoff_s, "modes": {}}

    def record(name, result):
        report["modes"][name] = result
        print(f"{name:28s} {result}", flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.vocab, m)
        record("engine in process", in_process(tmp, args, kwargs))
        worker = RolloutWorker(tmp, args.requests, engine_kwargs=kwargs)
        record("worker thread in process", through_worker(worker, False, args))
        worker.stop()
        del worker
        torch.cuda.empty_cache()
        import ray

        ray.init(num_cpus=8, num_gpus=1 if gpu else 0, include_dashboard=False)
        actor = RemoteRolloutWorker.options(num_gpus=gpu).remote(tmp, args.requests, 0, 1, kwargs)
        record("ray actor", through_worker(actor, True, args))

        @ray.remote(num_gpus=gpu)
        class Holder:  # a trainer rank between steps: a CUDA context and its memory, idle
            def __init__(self):
                self.blocks = torch.empty(8 * 2**30 if gpu else 1, dtype=torch.uint8, device=args.device)

            def ready(self):
                return True

        holder = Holder.remote()
        ray.get(holder.ready.remote())
        record("ray actor + idle CUDA peer", through_worker(actor, True, args))
        record("ray actor, handoff 0", through_worker(actor, True, argparse.Namespace(**{**vars(args), "handoff_s": 0.0})))
        ray.get(actor.sleep.remote(2))  # as a colocated run between steps: the KV cache freed, then allocated again
        ray.get(actor.wake_up.remote(None))
        record("ray actor after sleep/wake", through_worker(actor, True, args))


if __name__ == "__main__":
    main()
