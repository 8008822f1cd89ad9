"""Why DG collapses under flipped rewards (docs/performance.md): where each loss's push goes.

Samples the default task's warm-started policy (B prompts x G samples), scores them, flips a share of the
rewards as `friction.reward_flip` does, and takes each token's weight in the policy gradient at the first
mini-batch, where the importance ratio is 1: A for PPO's surrogate, sigmoid(A * surprisal / eta) * A for
DG's. It sums those weights over the tokens of right and of wrong answers (by the true reward), upward
(A > 0) and downward (A < 0). The question: does DG's gate hand the flipped samples more of the push than
PPO does?

    python benchmarks/dg_flip_diagnostic.py --output benchmarks/results/dg_flip_diagnostic_cpu.json

Shares are means over --seeds draws of prompts, samples and flips; each draw's own are in the file.
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch

from rlsys.bench import machine, write_report
from rlsys.data import load_datasets
from rlsys.models import load_tokenizer, prepare_model
from rlsys.reward.registry import reward_fn
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.startup import load_config
from rlsys.trainer.advantages import group_advantages
from rlsys.trainer.losses import delight_gate
from rlsys.types import Request, SamplingParams


def sample(engine: CPUEngine, tokenizer, score, params: SamplingParams, prompts, group_size: int):
    """Per prompt, its G samples as (token log-probs, true reward)."""
    for p, ids in zip(prompts, tokenizer([p.text for p in prompts])["input_ids"]):
        for g in range(group_size):
            engine.add(Request(f"{p.uid}/{g}", p.uid, ids, params))
    done = {}
    while len(done) < len(prompts) * group_size:
        done.update((c.request_id, c) for c in engine.step())
    return [[(done[f"{p.uid}/{g}"].logprobs, score(done[f"{p.uid}/{g}"].text, p.answer))
             for g in range(group_size)] for p in prompts]


def pushes(groups, flip: float, dg_eta: float, advantage: str, seed: int) -> dict:
    """Summed |token weight| per (loss, direction, answer), over the batch, as shares of the loss's total."""
    rng = random.Random(seed)
    sums = {loss: {f"{d} on {a}": 0.0 for d in ("up", "down") for a in ("right", "wrong")} for loss in ("ppo", "dg")}
    for group in groups:
        seen = [1.0 - r if rng.random() < flip else r for _, r in group]
        for (logprobs, truth), a in zip(group, group_advantages(seen, advantage)):
            if a == 0:
                continue
            key = f"{'up' if a > 0 else 'down'} on {'right' if truth > 0.5 else 'wrong'}"
            sums["ppo"][key] += abs(a) * len(logprobs)
            sums["dg"][key] += abs(a) * delight_gate(torch.tensor(a), torch.tensor(logprobs), dg_eta).sum().item()
    return {loss: {k: v / sum(s.values()) for k, v in s.items()} for loss, s in sums.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--flip", type=float, default=0.2)
    p.add_argument("--seeds", type=int, default=4, help="draws of prompts, samples and flips: 0 .. seeds-1")
    p.add_argument("--output")
    args = p.parse_args(argv)
    cfg = load_config(None)
    train, _ = load_datasets(cfg.data)
    model_dir = prepare_model(cfg)
    tokenizer, score = load_tokenizer(model_dir), reward_fn(cfg.reward.fn)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
    per_seed = []
    for seed in range(args.seeds):  # an engine per seed: it draws each request from (its seed, request id)
        engine = CPUEngine(str(model_dir), slots=64, seed=seed)
        prompts = random.Random(seed).sample(train, args.prompts)
        groups = sample(engine, tokenizer, score, params, prompts, cfg.control.group_size)
        per_seed.append({"seed": seed,
                         "right_share": sum(r > 0.5 for g in groups for _, r in g) / sum(len(g) for g in groups),
                         "clean": pushes(groups, 0.0, cfg.trainer.dg_eta, cfg.trainer.advantage, seed),
                         "flipped": pushes(groups, args.flip, cfg.trainer.dg_eta, cfg.trainer.advantage, seed)})
    mean = lambda case, loss, k: statistics.fmean(r[case][loss][k] for r in per_seed)  # noqa: E731
    report = {"command": f"python benchmarks/dg_flip_diagnostic.py --prompts {args.prompts} --flip {args.flip} "
                         f"--seeds {args.seeds}",
              "machine": machine(), "samples_per_seed": args.prompts * cfg.control.group_size,
              "dg_eta": cfg.trainer.dg_eta, "advantage": cfg.trainer.advantage, "seeds": per_seed,
              **{case: {loss: {k: mean(case, loss, k) for k in per_seed[0][case][loss]} for loss in ("ppo", "dg")}
                 for case in ("clean", "flipped")}}
    write_report(args.output, report)
    for r in per_seed:
        print(r["seed"], {loss: round(v["up on wrong"] - v["down on wrong"], 3) for loss, v in r["flipped"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
