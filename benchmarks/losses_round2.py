"""Issue 33's new losses, short live runs on the default task beside dapo: each recipe's trainer section over
configs/tiny.yaml (sync, 16 prompts x 8 samples per step), several seeds, the final accuracy with its error.

    python benchmarks/losses_round2.py --steps 60 --repeats 3 --output benchmarks/results/losses_round2_cpu.json

Issue 51's methods run the same way, named by their recipes:

    python benchmarks/losses_round2.py --steps 60 --repeats 3 --output benchmarks/results/losses_round3_cpu.json \
        --losses dapo,sapo,reinforce_pp,reinforce_pp_baseline,grpo_ref_sync,ppo_gae,lora_grpo

Issue 67's features run the same way beside dapo, named in FEATURES (reward_model builds its classifier first):

    python benchmarks/losses_round2.py --steps 60 --repeats 3 --output benchmarks/results/algorithms_round4_cpu.json \
        --losses dapo,cosine_warmup,ppo_epochs2,weighted_format,reward_model,kl_token_reinforce_pp

Run r uses `seed=r`: the same warm-started model, a different draw of samples. An existing --output is topped
up: a loss runs only the seeds it lacks. Each loss's runs are paired with dapo's by seed: the final accuracy's
difference (paired t, 95%) and dapo's step time over its own.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlsys.bench import (difference_figures, machine, paired, ratio_figures, repeated_accuracy, run_preset,
                         summarise_run, write_report)
from rlsys.config import CONFIG_DIR, read_yaml_mapping

LOSSES = ("dapo", "cispo", "gmpo", "clip_cov", "kl_cov")  # dapo: the default config as it is, for reference
RECIPES = Path(CONFIG_DIR) / "recipes"
RUN_KEYS = ("initial_accuracy", "final_accuracy", "final_accuracy_se", "samples", "wall_s", "step_time_s")
REWARD_MODEL = Path("runs/round4_reward_model")
# Issue 67's features: name -> (the recipe whose trainer section they start from, None for dapo; their overrides)
FEATURES = {
    "cosine_warmup": (None, ["trainer.lr_schedule=cosine", "trainer.lr_warmup_ratio=0.1", "trainer.min_lr_ratio=0.1"]),
    "ppo_epochs2": (None, ["trainer.ppo_epochs=2"]),
    # a well-formed answer (one non-empty line) at a fifth of a right one's worth: TRL's correctness + format pair
    "weighted_format": (None, ["reward.fn=[exact_match,format]", "reward.weights=[1.0,0.2]"]),
    # an untrained classifier (scores within about ±0.1) at a tenth: the plumbing and its cost, not what a reward
    # model is worth; grpo's std scaling still makes its noise the whole advantage of a group that scores alike
    "reward_model": (None, ["reward.fn=[exact_match,reward_model]", "reward.weights=[1.0,0.1]",
                            f"reward.model.path={REWARD_MODEL}"]),
    "kl_token_reinforce_pp": ("reinforce_pp", ["trainer.kl.reward_level=token"]),
}


def dotted(tree: dict, prefix: str) -> list[str]:
    """A YAML section as key=value overrides."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        out += dotted(value, name) if isinstance(value, dict) else [f"{name}={json.dumps(value)}"]
    return out


def recipe_overrides(loss: str) -> list[str]:
    """The trainer section of configs/recipes/<loss>.yaml (none for dapo, the default config's own loss), or a
    feature's (FEATURES)."""
    recipe, extra = FEATURES.get(loss, (loss, []))
    if recipe in (None, "dapo"):
        return extra
    return dotted(read_yaml_mapping(RECIPES / f"{recipe}.yaml", "recipe")[0]["trainer"], "trainer") + extra


def build_reward_model(out: Path) -> None:
    """A tiny Qwen2 sequence classifier (one label) as transformers initialises it, with the policy's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlsys.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=512, num_labels=1, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id)).save_pretrained(out)
    tok.save_pretrained(out)


def run_loss(loss: str, seed: int, steps: int, out_dir: Path) -> dict:
    overrides = [*recipe_overrides(loss), f"seed={seed}", f"trainer.total_steps={steps}",
                 f"control.eval_every={steps}", "control.save_every=0"]
    if f"reward.model.path={REWARD_MODEL}" in overrides:
        if not (REWARD_MODEL / "config.json").exists():
            build_reward_model(REWARD_MODEL)
        overrides.append(f"reward.model.path={REWARD_MODEL.resolve()}")  # the reward actors may start elsewhere
    summary = summarise_run(run_preset(None, overrides, out_dir / f"{loss}-seed{seed}"), target=1.0)
    return {"seed": seed, **{k: summary[k] for k in RUN_KEYS}}


def versus_dapo(results: dict) -> None:
    """Each loss's final accuracy less dapo's of the same seed (paired t, 95%) and dapo's step time over its own."""
    base = results.get("dapo", {}).get("runs", [])
    for loss, result in results.items():
        if loss != "dapo" and base:
            pairs = paired(base, result["runs"])
            result["final_accuracy_vs_dapo"] = difference_figures(pairs, "final_accuracy")
            result.update(ratio_figures(pairs, "step_time_s", "step_time_dapo_over_this"))


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
            versus_dapo(report["results"])
            write_report(args.output, report)
            print(f"{loss} seed {seed}: {time.time() - t:.0f}s, final {runs[-1]['final_accuracy']:.3f}; "
                  f"mean {mean:.3f} ± {se:.3f} over {len(runs)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
