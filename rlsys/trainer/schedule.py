"""Learning-rate warm-up and decay (trainer.lr_schedule; the critic's: trainer.critic.lr_schedule).

The factor on trainer.lr at each train step, counted from 0, with W warm-up steps out of T = trainer.total_steps:
  constant  s / W while s < W, then 1                                 (veRL's constant warm-up, transformers' too)
  cosine    r + (1 - r) s / W while s < W, then                       (veRL's get_cosine_schedule_with_warmup,
            max(r, r + (1 - r) (1 + cos(pi p)) / 2), p = (s - W) / (T - W)         r = trainer.min_lr_ratio)
  linear    s / W while s < W, then max(0, (T - s) / (T - W))         (transformers' linear schedule, TRL's default)
A factor of 0 at step 0 is the warm-up's own: veRL's and transformers' first update under warm-up does not move.

Stepped once per train step, after all of its PPO mini-batches and epochs, as veRL steps its scheduler after
update_policy: every update of one step takes the same rate. It lives beside the optimizer, not inside a DeepSpeed
engine, which would step it at every engine.step (every mini-batch).
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlsys.config import TrainerConfig


def warmup_steps(cfg: TrainerConfig) -> int:
    """trainer.lr_warmup_steps, or int(trainer.lr_warmup_ratio x trainer.total_steps) as veRL rounds it."""
    return cfg.lr_warmup_steps if cfg.lr_warmup_steps is not None else int(cfg.lr_warmup_ratio * cfg.total_steps)


def lr_factor(cfg: TrainerConfig, step: int) -> float:
    """The share of trainer.lr that train step `step` (from 0) takes."""
    warmup, total, floor = warmup_steps(cfg), cfg.total_steps, cfg.min_lr_ratio
    if step < warmup:  # min_lr_ratio is cosine's alone (config validation): 0 here for the others
        return floor + (1.0 - floor) * step / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(floor, floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig, taken: int = 0) -> LambdaLR:
    """The schedule on `optimizer`, `taken` train steps into it (a resumed run), its rate set for the next."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr  # what the factor multiplies, whatever rate a checkpoint's groups hold
    return LambdaLR(optimizer, lambda step: lr_factor(cfg, step), last_epoch=taken - 1)
