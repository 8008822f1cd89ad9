"""Issue 21's experiment: a real rollout-trainer mismatch on a CPU. The built-in engine samples in bfloat16
while the trainer computes in float32; does the mismatch cost accuracy, and does TIS keep it?

    python benchmarks/mismatch_bf16.py --output benchmarks/results/mismatch_bf16_cpu.json

Variants, on the default config: fp32 engine (no mismatch but kernels), bf16 engine uncorrected, bf16 with
token-level TIS (trainer.mismatch.mode=tis). `train/mismatch_kl` (k3 KL of the engine's log-probs against the
trainer's forward of the first mini-batch) measures the mismatch in every variant; the uncorrected one uses the
engine's log-probs as pi_old.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rlsys.bench import accuracy_difference, machine, run_preset, summarise_run, write_report

VARIANTS = {
    "bf16-uncorrected": ["rollout.dtype=bfloat16"],
    "bf16-tis": ["rollout.dtype=bfloat16", "trainer.mismatch.mode=tis"],
    "fp32-tis": ["rollout.dtype=float32", "trainer.mismatch.mode=tis"],  # the kernels' own KL
}


def mismatch_figures(rows: list[dict]) -> dict:
    steps = [r for r in rows if "train/mismatch_kl" in r]
    kls = [r["train/mismatch_kl"] for r in steps]
    cut = [r["train/mismatch_corrected_fraction"] for r in steps if "train/mismatch_corrected_fraction" in r]
    return {"mismatch_kl_mean": statistics.fmean(kls) if kls else None, "mismatch_kl_max": max(kls, default=None),
            "mismatch_truncated_share_mean": statistics.fmean(cut) if cut else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out-dir", default="runs/mismatch_bf16")
    p.add_argument("--output")
    args = p.parse_args(argv)
    start, results = machine(), {}
    for name in args.variants.split(","):
        rows = run_preset(None, args.overrides + VARIANTS[name], Path(args.out_dir) / name)
        results[name] = summarise_run(rows, target=1.0) | mismatch_figures(rows)
        print(name, json.dumps({k: results[name][k] for k in ("final_accuracy", "final_accuracy_se",
                                                             "mismatch_kl_mean")}), flush=True)
    base = results.get("bf16-uncorrected")
    for r in results.values():
        r["final_accuracy_vs_uncorrected"] = accuracy_difference(r, base) if base else None
    report = {"command": "python benchmarks/mismatch_bf16.py " + " ".join(args.overrides),
              "workload": {"config": "configs/tiny.yaml", "overrides": args.overrides, "variants": VARIANTS},
              "machine": start, "results": results, "mismatch_kl_every_mode": True}
    write_report(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
