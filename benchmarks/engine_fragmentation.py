"""The built-in engine's decode step as its slots fragment: time and peak new memory per step, on the CPU.

Requests finish out of order, so the slots of one length bucket end up scattered among other buckets'.
Two layouts of the same S requests (half long prompts, half short): `contiguous` (long in slots 0..S/2-1)
and `fragmented` (long in every other slot). A step whose attention gathers scattered cache rows, or builds
its masks afresh, holds more memory and host time in the fragmented layout; one that reads views of the
cache and of the mask kept beside it holds the same.

    python benchmarks/engine_fragmentation.py [--slots 32] [--long 900] [--steps 20] [--label NAME]

Figures go to benchmarks/results/engine_fragmentation_cpu.json under the label (default: the git commit),
so a run before and after a change sit side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlsys.bench import machine, write_report  # noqa: E402
from rlsys.rollout.builtin_engine import CPUEngine  # noqa: E402
from rlsys.types import Request, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engine_fragmentation_cpu.json"


def build_model(folder: Path, max_len: int) -> Path:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, intermediate_size=128, max_position_embeddings=max_len)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def peak_new_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(model_dir: Path, slots: int, long: int, steps: int, fragmented: bool) -> dict:
    engine = CPUEngine(str(model_dir), slots=slots)
    for slot in range(slots):
        is_long = slot % 2 == 0 if fragmented else slot < slots // 2
        prompt = [(slot + 3 * j) % 64 for j in range(long if is_long else 8)]
        engine.add(Request(f"r{slot}", "p", prompt, SamplingParams(max_new_tokens=steps + 3, temperature=0.0)))
    engine.step()  # the prefill: each request takes the slot of its index
    assert [e.request.request_id for e in engine.slot_owner] == [f"r{s}" for s in range(slots)]
    peak = peak_new_bytes(engine.step)
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"step_ms_median": round(1e3 * statistics.median(wall), 3),
            "step_cpu_ms_median": round(1e3 * statistics.median(cpu), 3), "step_peak_new_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--long", type=int, default=900)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True, cwd=Path(__file__).parent).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.long + args.steps + 8)
        layouts = {name: measure(model_dir, args.slots, args.long, args.steps, name == "fragmented")
                   for name in ("contiguous", "fragmented")}
    c, f = layouts["contiguous"], layouts["fragmented"]
    layouts["fragmented_over_contiguous"] = {
        "step_ms": round(f["step_ms_median"] / c["step_ms_median"], 3),
        "step_peak_new_bytes": round(f["step_peak_new_bytes"] / c["step_peak_new_bytes"], 3)}
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    report["command"] = "python benchmarks/engine_fragmentation.py " + " ".join(sys.argv[1:])
    report["machine"] = machine() | {"torch_threads": 1}
    report["settings"] = {"slots": args.slots, "long_prompt": args.long, "short_prompt": 8, "steps": args.steps}
    report.setdefault("runs", {})[label] = layouts
    write_report(RESULTS, report)
    print(json.dumps({label: layouts}, indent=1))


if __name__ == "__main__":
    main()
