"""The decode attentions of rlsys/rollout/attention.py on the CPU: their error against a float64 reference (float32
and bf16 inputs) and their time, one thread, on the built-in engine's decode shapes.

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_cpu.json
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rlsys, when run as a script from anywhere
from rlsys.bench import machine, write_report  # noqa: E402
from rlsys.rollout.attention import DECODE_ATTENTION  # noqa: E402

# (sequences, kv heads, group, head_dim, keys): the tiny test model's, the 0.47B bench model's at 32 x 640 and 1 x 4096
# (split_kv hands 64 sequences of it to sdpa: attention.SPLIT_BELOW_ROWS)
SHAPES = [(8, 2, 2, 32, 256), (32, 2, 8, 64, 640), (1, 2, 8, 64, 4096)]


def inputs(n, KV, G, D, K, dtype, gen):
    """Keys and values as views of a longer cache, as the engine's; scores up to ~30."""
    q = 2 * torch.randn(n, KV, G, D, generator=gen)
    cache = 2 * torch.randn(2, n, KV, K + 1, D, generator=gen)
    return [t.to(dtype) for t in (q, cache[0, :, :, :K], cache[1, :, :, :K] / 2, torch.zeros(n, 1, 1, K))]


def reference(q, keys, values, mask):
    q, keys, values, mask = (t.double() for t in (q, keys, values, mask))
    return torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, -1) @ values


def timed_ms(fns: dict, args, repeats: int, rounds: int = 5) -> dict[str, float]:
    """Each function's fastest round of `repeats` calls, the functions' rounds interleaved (a shared CPU's load
    moves between rounds, not within the comparison)."""
    best = {name: math.inf for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn(*args)
            start = time.perf_counter()
            for _ in range(repeats):
                fn(*args)
            best[name] = min(best[name], (time.perf_counter() - start) / repeats * 1e3)
    return {name: round(ms, 3) for name, ms in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, KV, G, D, K in SHAPES:
        row = {"sequences": n, "kv_heads": KV, "group": G, "head_dim": D, "keys": K}
        for dtype in (torch.float32, torch.bfloat16):
            q, keys, values, mask = inputs(n, KV, G, D, K, dtype, gen)
            expected = reference(q, keys, values, mask)
            scale = expected.abs().max().item()
            for name, fn in DECODE_ATTENTION.items():
                error = (fn(q, keys, values, mask).double() - expected).abs().max().item()
                row[f"{name}_{dtype_name(dtype)}_error_over_max_output"] = float(f"{error / scale:.3g}")
        q, keys, values, mask = inputs(n, KV, G, D, K, torch.float32, gen)
        for name, ms in timed_ms(DECODE_ATTENTION, (q, keys, values, mask), args.repeats).items():
            row[f"{name}_float32_ms"] = ms
        rows.append(row)
        print(row)
    out = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
           "what": __doc__.split("\n\n")[0].replace("\n", " "),
           "machine": machine() | {"threads": 1}, "rows": rows}
    write_report(args.out, out)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    main()
