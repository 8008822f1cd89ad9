"""PPO with a value model (veRL's adv_estimator=gae): the critic, GAE, and the step that trains both.

Where the critic lives: in the trainer actors, beside the policy. Each rank holds a second backend of the run's
kind (`TorchCritic`, or `DeepSpeedCritic` in deepspeed_backend.py: its own DeepSpeed engine with the same ZeRO
stage, dtype and offload settings, and its own AdamW), in the same process group. Its own actors would need a
second process group and every sample sent twice; here the step's samples are on the rank already, the critic's
collectives (its forwards under ZeRO-3, the whitening's sums) run in the group that exists, and a checkpoint is one
call per rank. The cost is a second model and its optimizer state in each rank's memory, as in veRL's colocated
critic.

The value model: the policy's architecture with a scalar head (transformers' ...ForTokenClassification with one
label, as veRL's critic), its body initialised from model.path (the policy's initial weights: veRL's
critic.model.path is usually the actor's), its head at random (seeded by trainer.seed).

Values are the current critic's, computed on the trainer when the step trains: under every scheduler, async's
stale samples included, GAE reads the critic as it is at that update, not as it was when the samples were drawn
(veRL too computes them just before its update).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForTokenClassification

from rlsys.config import GAEConfig, KLConfig, LoraConfig, MismatchConfig, TrainerConfig
from rlsys.trainer.backend import DTYPES, TorchBackend
from rlsys.trainer.batching import MicroBatch, StepTotals, TrainSample, collate

CRITIC_DIR = "critic"  # the critic's checkpoint, a subfolder of the trainer's (the export leaves it out)
STEPS_FILE = "critic_steps.json"  # train steps taken, for trainer.critic.warmup_steps
WHITEN_EPS = 1e-8  # veRL's masked_whiten


def critic_config(cfg: TrainerConfig) -> TrainerConfig:
    """The critic backend's settings: the trainer's layout (backend, ZeRO, dtype, micro-batches), trainer.critic's
    learning rate, its schedule and clip, and none of the policy's loss options (no KL reference, LoRA, or
    mismatch)."""
    schedule = {k: getattr(cfg.critic, k) for k in ("lr_schedule", "lr_warmup_steps", "lr_warmup_ratio",
                                                     "min_lr_ratio")}
    return cfg.model_copy(update={"lr": cfg.critic.lr, "grad_clip": cfg.critic.grad_clip, "kl": KLConfig(),
                                  "lora": LoraConfig(), "mismatch": MismatchConfig(), **schedule})


# --- the formulas ---------------------------------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, T] each, as veRL's compute_gae_advantage_return before its whitening:
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns A + V. A masked position (a
    tool's token, padding) is skipped: the next value and advantage carry over it."""
    next_value, last = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        step = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
        next_value = values[:, t] * m + (1 - m) * next_value
        last = step * m + (1 - m) * last
        advantages[:, t] = last
    return advantages, advantages + values


def whiten(values: torch.Tensor, mask: torch.Tensor, sum_over_ranks: Callable[[dict], dict]) -> torch.Tensor:
    """veRL's masked_whiten over the whole step's tokens, every rank's: (x - mean) / sqrt(var + 1e-8), the variance
    Bessel-corrected. Fewer than two tokens in all: zeros."""
    found = sum_over_ranks({"count": mask.sum().item(), "sum": (values * mask).sum().item()})
    count = found["count"]
    if count < 2:
        return torch.zeros_like(values)
    mean = found["sum"] / (count + WHITEN_EPS)
    squares = sum_over_ranks({"squares": ((values - mean) ** 2 * mask).sum().item()})["squares"]
    var = squares / (count + WHITEN_EPS) * count / (count - 1)
    return (values - mean) / math.sqrt(var + WHITEN_EPS)


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
               clip: float, tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL's compute_value_loss, token-mean over the step's `tokens` (this micro-batch's share):
    0.5 max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2). value_clip_fraction: tokens where the clipped
    error is the larger."""
    clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(unclipped_error, clipped_error) * mask).sum() / tokens
    clip_share = ((clipped_error > unclipped_error).float() * mask).sum().item() / tokens
    return loss, {"value_loss": loss.item(), "value_clip_fraction": clip_share}


def value_forward(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Each position's value, [B, L-1] as the log-probs: position t values the state before token t + 1."""
    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1, 0].float()


def set_advantages(samples: list[TrainSample], values: list[list[float]], cfg: GAEConfig,
                   sum_over_ranks: Callable[[dict], dict]) -> None:
    """Each sample's token advantages (GAE, whitened over the step), returns and values, from its reward placed on
    its last trained token and the critic's `values` of its response tokens."""
    width = max((len(v) for v in values), default=0)
    rewards, old, mask = (torch.zeros(len(samples), width, dtype=torch.float64) for _ in range(3))
    for i, (sample, v) in enumerate(zip(samples, values)):
        old[i, :len(v)] = torch.tensor(v, dtype=torch.float64)
        mask[i, :len(v)] = torch.tensor(sample.mask or [1] * len(v), dtype=torch.float64)
        rewards[i, int(mask[i].nonzero().max())] = sample.reward
        if sample.kl_penalties is not None:  # trainer.kl.reward_level=token: each token's KL off its own reward
            rewards[i, :len(v)] -= torch.tensor(sample.kl_penalties, dtype=torch.float64)
    advantages, returns = gae(rewards, old, mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, mask, sum_over_ranks)
    for i, (sample, v) in enumerate(zip(samples, values)):
        n = len(v)
        sample.token_advantages, sample.returns, sample.values = advantages[i, :n].tolist(), returns[i, :n].tolist(), v


# --- the critic -----------------------------------------------------------------------------------------------------
class Critic:
    """Mixed in before a TrainerBackend class: the backend's model is the value model, trained on the value loss.
    Checkpoints, the optimizer step and ZeRO are the backend's own."""

    steps = 0  # train steps taken: the first trainer.critic.warmup_steps - 1 of them train the critic alone

    def _load_trained_model(self) -> torch.nn.Module:
        model = AutoModelForTokenClassification.from_pretrained(self.model_dir, num_labels=1, use_safetensors=True,
                                                                dtype=DTYPES[self.cfg.dtype])
        model.eval()  # no dropout, as the policy
        return model

    @torch.no_grad()
    def values(self, samples: list[TrainSample], micro_batches: int) -> list[list[float]]:
        """The current values of each sample's response tokens, in input order (`micro_batches` forwards)."""
        found: dict[int, list[float]] = {}
        for batch in self._micro_batches(samples, micro_batches):
            values = value_forward(self.model, collate(batch).to(self.device))
            for row, sample in enumerate(batch):
                found[id(sample)] = values[row, sample.prompt_len - 1:sample.num_tokens - 1].tolist()
        return [found[id(s)] for s in samples]

    def accumulate_gradients(self, samples: list[TrainSample], totals: StepTotals, closes_step: bool = True,
                             **_) -> dict:
        """The value loss's gradients over this rank's micro-batches (the samples carry returns and old values)."""
        stats = {"value_loss": 0.0, "value_clip_fraction": 0.0}
        batches = self._micro_batches(samples, totals.micro_batches)
        for i, batch in enumerate(batches):
            self._start_micro_batch(last=closes_step and i == len(batches) - 1)
            mb = collate(batch).to(self.device)
            returns = mb.returns if mb.returns is not None else torch.zeros_like(mb.response_mask)  # padding row
            old = mb.old_values if mb.old_values is not None else returns
            loss, mb_stats = value_loss(value_forward(self.model, mb), returns, old, mb.response_mask,
                                        self.cfg.critic.value_clip, float(totals.tokens))
            self._backward(loss)
            for k, v in mb_stats.items():
                stats[k] += v
        return stats

    def save(self, folder: str) -> None:
        super().save(folder)
        if self.rank == 0:
            (Path(folder) / STEPS_FILE).write_text(json.dumps({"steps": self.steps}))

    def load(self, folder: str) -> None:
        if not (Path(folder) / STEPS_FILE).exists():
            raise ValueError(f"{Path(folder).parent} has no critic: it was saved by a run without "
                             "trainer.advantage=gae, so a PPO run cannot resume from it")
        super().load(folder)
        self.steps = json.loads((Path(folder) / STEPS_FILE).read_text())["steps"]


class TorchCritic(Critic, TorchBackend):
    """The critic on the plain torch backend."""


def warming_up(steps_taken: int, warmup_steps: int) -> bool:
    """Whether the step after `steps_taken` trains the critic alone: as veRL, which counts steps from 1 and updates
    the actor once critic_warmup <= that count, so trainer.critic.warmup_steps=N trains the critic alone N - 1 times."""
    return steps_taken + 1 < warmup_steps


def train_ppo_step(actor, critic: Critic, samples: list[TrainSample], parts: list[tuple[list[TrainSample], StepTotals]],
                   critic_parts: list[tuple[list[TrainSample], StepTotals]], fresh: bool, proximal_micro_batches: int,
                   version: int | None, value_micro_batches: int) -> dict:
    """One PPO step on this rank over its `samples`: the critic values them, GAE gives each token its advantage, then
    the critic takes one update per part of `critic_parts` and (after its warm-up, `warming_up`) the policy one per
    part of `parts`, critic first as veRL (parts: mini-batches of every PPO epoch). Metrics: the policy's (tokens
    and sequences alone while warming up), value_loss, value_clip_fraction, critic_grad_norm, critic_skipped_steps,
    critic_lr."""
    set_advantages(samples, critic.values(samples, value_micro_batches), actor.cfg.gae, critic.sum_over_ranks)
    trained = critic.merge_mini_batches([critic.train_step(part, totals) for part, totals in critic_parts])
    trained["lr"] = critic.end_step()
    warming = warming_up(critic.steps, actor.cfg.critic.warmup_steps)
    critic.steps += 1
    if warming:
        metrics = {"tokens": sum(s.trained_tokens for s in samples), "sequences": len(samples),
                   "skipped_steps": actor.skipped_steps}
    else:
        metrics = actor.train_mini_batches(parts, fresh, proximal_micro_batches, version)
    names = {"grad_norm": "critic_grad_norm", "skipped_steps": "critic_skipped_steps", "lr": "critic_lr"}
    return metrics | {names.get(k, k): v for k, v in trained.items()
                      if k in names or k.startswith("value_")}
