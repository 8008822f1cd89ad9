"""Issue 33's new losses, short live runs on the default task beside dapo: each recipe's trainer section over
configs/tiny.yaml (sync, 16 prompts x 8 samples per step), several seeds, the final accuracy with its error.

    python benchmarks/losses_round2.py --steps 60 --repeats 3 --output benchmarks/results/losses_round2_cpu.json

Issue 51's methods run the same way, named by their recipes:

    python benchmarks/losses_round2.py --steps 60 --repeats 3 --output benchmarks/results/losses_round3_cpu.json \
        --losses dapo,sapo,reinforce_pp,reinforce_pp_baseline,grpo_ref_sync,ppo_gae,lora_grpo

Run r uses `seed=r`: the same warm-started model, a different draw of samples. An existing --output is topped
up: a loss runs only the seeds it lacks.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlsys.bench import machine, repeated_accuracy, run_preset, summarise_run, write_report
from rlsys.config import CONFIG_DIR, read_yaml_mapping

LOSSES = ("dapo", "cispo", "gmpo", "clip_cov", "kl_cov")  # dapo: the default config as it is, for reference
RECIPES = Path(CONFIG_DIR) / "recipes"
RUN_KEYS = ("initial_accuracy", "final_accuracy", "final_accuracy_se", "samples", "wall_s")


def dotted(tree: dict, prefix: str) -> list[str]:
    """A YAML section as key=value overrides."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        out += dotted(value, name) if isinstance(value, dict) else [f"{name}={json.dumps(value)}"]
    return out


def recipe_overrides(loss: str) -> list[str]:
    """The trainer section of configs/recipes/<loss>.yaml (none for dapo, the default config's own loss)."""
    if loss == "dapo":
        return []
    return dotted(read_yaml_mapping(RECIPES / f"{loss}.yaml", "recipe")[0]["trainer"], "trainer")


def run_loss(loss: str, seed: int, steps: int, out_dir: Path) -> dict:
    overrides = [*recipe_overrides(loss), f"seed={seed}", f"trainer.total_steps={steps}",
                 f"control.eval_every={steps}", "control.save_every=0"]
    summary = summarise_run(run_preset(None, overrides, out_dir / f"{loss}-seed{seed}"), target=1.0)
    return {"seed": seed, **{k: summary[k] for k in RUN_KEYS}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2, help="runs per loss, seeds 0 .. repeats-1")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--out-dir", default="runs/losses_round2")
    p.add_argument("--output", required=True, help="the report JSON; an existing one is topped up")
    args = p.parse_args(argv)
    path = Path(args.output)
    report = json.loads(path.read_text()) if path.exists() else {
        "workload": {"config": "configs/tiny.yaml", "steps": args.steps,
                     "overrides": {loss: recipe_overrides(loss) for loss in args.losses.split(",")}},
        "machines": [], "results": {}}
    if report["workload"]["steps"] != args.steps:
        raise SystemExit(f"{path}: its runs are {report['workload']['steps']} steps, not --steps {args.steps}")
    report["command"] = (f"python benchmarks/losses_round2.py --steps {args.steps} --repeats {args.repeats} "
                         f"--output {args.output} --losses {args.losses}")
    report["machines"].append(machine())
    for seed in range(args.repeats):  # seed outer: machine drift hits every loss alike
        for loss in args.losses.split(","):
            runs = report["results"].get(loss, {}).get("runs", [])
            if any(r["seed"] == seed for r in runs):
                continue
            t = time.time()
            runs = runs + [run_loss(loss, seed, args.steps, Path(args.out_dir))]
            mean, se = repeated_accuracy(runs)
            report["results"][loss] = {"runs": runs, "n": len(runs), "final_accuracy": mean, "final_accuracy_se": se}
            write_report(args.output, report)
            print(f"{loss} seed {seed}: {time.time() - t:.0f}s, final {runs[-1]['final_accuracy']:.3f}; "
                  f"mean {mean:.3f} ± {se:.3f} over {len(runs)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
