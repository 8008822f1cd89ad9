"""What a weight update costs the built-in CPU engine with weights.running_requests=recompute against keep.

Every slot holds a running request `--context` tokens long (prompt + tokens generated so far) when a new
version arrives (`load_weights` of a full state dict). `keep` copies the weights in; `recompute` then also
prefills every running sequence again under them. Reported per update, as the best of --repeats runs
(the two modes alternate, so a shared machine's load hits both alike), beside one decode step's time.

    python benchmarks/running_requests.py [--slots 32] [--context 64] [--threads 1] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from engine_throughput import build_model, timed
from rlsys.bench import machine, write_report
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.types import Request, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "running_requests_cpu.json"
VOCAB = 40


def running_engine(model_dir: str, mode: str, slots: int, context: int, prompt_len: int) -> CPUEngine:
    """An engine whose every slot runs a request that has reached `context` tokens."""
    engine = CPUEngine(model_dir, slots=slots, running_requests=mode, max_len=4 * context)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=3 * context, temperature=1.0, seed=0)
    for i in range(slots):
        engine.add(Request(f"r{i}", "p", torch.randint(1, VOCAB, (prompt_len,), generator=g).tolist(), params))
    for _ in range(context - prompt_len):
        engine.step()
    return engine


def wall_ms(fn) -> float:
    return timed(fn)[0] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        weights = {k: v.clone() for k, v in build_model(Path(tmp), VOCAB).state_dict().items()}
        engines = {mode: running_engine(tmp, mode, args.slots, args.context, args.prompt_len)
                   for mode in ("keep", "recompute")}
        times: dict[str, list[float]] = {"keep": [], "recompute": [], "decode_step": []}
        for version in range(1, args.repeats + 1):
            for mode, engine in engines.items():
                times[mode].append(wall_ms(lambda: engine.load_weights(weights, version)))
            times["decode_step"].append(wall_ms(engines["keep"].step))
    best = {name: round(min(ms), 3) for name, ms in times.items()}
    report = {
        "machine": machine(),
        "settings": vars(args),
        "update_ms": {"keep": best["keep"], "recompute": best["recompute"]},
        "recompute_extra_ms": round(best["recompute"] - best["keep"], 3),
        "decode_step_ms": best["decode_step"],
        "recompute_extra_in_decode_steps": round((best["recompute"] - best["keep"]) / best["decode_step"], 1),
        "all_ms": {name: [round(t, 3) for t in ms] for name, ms in times.items()},
    }
    write_report(RESULTS, report)
    print(json.dumps({k: report[k] for k in ("update_ms", "recompute_extra_ms", "decode_step_ms",
                                              "recompute_extra_in_decode_steps")}))


if __name__ == "__main__":
    main()
