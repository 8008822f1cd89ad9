"""From scored groups to tensors: samples with advantages, split across ranks, packed into micro-batches.

The plan of a step is made once, in the driver, so every rank knows the step's totals (what the
losses divide by) and runs the same number of micro-batches: ZeRO-2/3 communicate on every
forward/backward, so a rank with less data pads with empty micro-batches rather than stop early.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsys.trainer.advantages import reinforce_pp_token_returns, step_advantages
from rlsys.types import Completion, Group

PAD_ID = 0  # padding positions are masked out of attention and loss, so the id never matters


@dataclass
class TrainSample:
    input_ids: list[int]  # prompt ids + response ids
    prompt_len: int
    advantage: float
    logprobs: list[float]  # behaviour log-prob of each response token
    versions: list[int]  # policy version that sampled each response token
    proximal_logprobs: list[float] | None = None  # under the weights at the start of the step, when known
    # A conversation's (Completion.mask): 1 per model token, 0 per tool token; a tool's tokens are context only,
    # out of the loss, KL, entropy, the mismatch statistics and the token counts. None: every token is trained.
    mask: list[int] | None = None
    reward: float = 0.0  # its return less any KL penalty: trainer.advantage=gae places it on its last trained token
    kl_penalties: list[float] | None = None  # trainer.kl.reward_level=token, gae: coef x KL off each token's reward
    # trainer.advantage=gae, set on the trainer rank when the step trains (critic.py), one per response token: the
    # whitened advantages (in place of `advantage`), the returns and the critic's values the step started with
    token_advantages: list[float] | None = None
    returns: list[float] | None = None
    values: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        """Response tokens the model sampled: what the loss counts (a tool's answer is not among them)."""
        return sum(self.mask) if self.mask is not None else len(self.input_ids) - self.prompt_len


@dataclass(frozen=True)
class StepTotals:
    """The whole step, over every rank and micro-batch: what losses normalise by."""
    tokens: int  # response tokens
    sequences: int
    micro_batches: int  # run by every rank


def trained_tokens(c: Completion, mask_truncated: bool = False) -> int:
    """The tokens of a completion the model sampled and the step trains (none of one cut by the length limit, under
    trainer.mask_truncated_completions: finish_reason "length", as TRL's mask takes a completion without EOS)."""
    if mask_truncated and c.finish_reason == "length":
        return 0
    return sum(c.mask) if c.mask else len(c.token_ids)


def build_samples(groups: list[Group], advantage: str, penalties: list[float] | None = None,
                  mask_truncated: bool = False) -> list[TrainSample]:
    """One sample per completion with a token to train; empty responses, conversations dropped from training
    (every token masked) and, with `mask_truncated` (trainer.mask_truncated_completions), completions cut by the
    length limit still count in their group's advantages.
    `penalties`: one per sample returned, in order (trainer.kl.in_reward's coef x KL), taken off its reward
    before its group's advantages."""
    penalty = iter(penalties or [])
    rewards, tokens = [], []
    for group in groups:
        trained = [trained_tokens(s.completion, mask_truncated) for s in group.samples]
        group_rewards = group.rewards
        if penalties is not None:
            group_rewards = [r - (next(penalty) if n else 0.0) for r, n in zip(group_rewards, trained)]
        rewards.append(group_rewards)
        tokens.append(trained)
    samples = []
    for group_rewards, advantages, trained, group in zip(rewards, step_advantages(rewards, tokens, advantage), tokens,
                                                        groups):
        for scored, adv, n, reward in zip(group.samples, advantages, trained, group_rewards):
            c = scored.completion
            if not n:
                continue
            if not c.prompt_ids:
                raise ValueError(f"completion {c.request_id}: empty prompt, so no position predicts its first token")
            if len(c.logprobs) != len(c.token_ids) or len(c.versions) != len(c.token_ids):
                raise ValueError(f"completion {c.request_id}: {len(c.token_ids)} tokens but {len(c.logprobs)} "
                                 f"log-probs and {len(c.versions)} versions; the engine must record one per token")
            if c.mask and len(c.mask) != len(c.token_ids):
                raise ValueError(f"completion {c.request_id}: {len(c.token_ids)} tokens but a mask of {len(c.mask)}")
            samples.append(TrainSample(list(c.prompt_ids) + list(c.token_ids), len(c.prompt_ids), float(adv),
                                       list(c.logprobs), list(c.versions), mask=list(c.mask) or None,
                                       reward=float(reward)))
    return samples


TOKEN_KL_ADVANTAGES = ("gae", "reinforce_pp")  # the advantages whose returns differ token by token


def place_token_kl(samples: list[TrainSample], penalties: list[list[float]], advantage: str) -> None:
    """trainer.kl.reward_level=token: each token's penalty (coef x its KL) off that token's reward, the samples' own
    rewards untouched: gae carries them to GAE on the trainer (critic.set_advantages), reinforce_pp takes its token
    advantages here."""
    if advantage == "gae":
        for sample, penalty in zip(samples, penalties):
            sample.kl_penalties = list(penalty)
        return
    masks = [s.mask or [1] * len(p) for s, p in zip(samples, penalties)]
    for sample, advantages in zip(samples, reinforce_pp_token_returns([s.reward for s in samples], penalties, masks)):
        sample.token_advantages = advantages


def sampled_by(samples: list[TrainSample], version: int | None) -> bool:
    """Every token of `samples` was sampled by the weights of `version` (None: not known, so no)."""
    return version is not None and all(v == version for s in samples for v in s.versions)


def split_across_ranks(samples: list[TrainSample], world_size: int) -> list[list[TrainSample]]:
    """Longest first, each to the rank with the fewest tokens so far: near-equal work per rank."""
    ranks: list[list[TrainSample]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for sample in sorted(samples, key=lambda s: -s.num_tokens):
        r = load.index(min(load))
        ranks[r].append(sample)
        load[r] += sample.num_tokens
    return ranks


def pack_micro_batches(samples: list[TrainSample], token_budget: int) -> list[list[TrainSample]]:
    """Longest first; a micro-batch takes samples while rows x longest row stays within the budget.

    Padding counts against the budget. A sample longer than the budget gets a micro-batch of its own.
    """
    batches: list[list[TrainSample]] = []
    for sample in sorted(samples, key=lambda s: -s.num_tokens):
        current = batches[-1] if batches else None
        if current and (len(current) + 1) * current[0].num_tokens <= token_budget:
            current.append(sample)
        else:
            batches.append([sample])
    return batches


def mini_batch_ends(items: int, count: int) -> list[int]:
    """Where `count` contiguous, near-equal slices of `items` things end (at most one slice per thing)."""
    count = max(1, min(count, items))
    return [round(i * items / count) for i in range(1, count + 1)]


def split_mini_batches(samples: list[TrainSample], count: int) -> list[list[TrainSample]]:
    """`count` contiguous, near-equal slices in the scheduler's order (a group's samples stay together
    when the groups are equal in size; under SortedRL the order is short to long, a micro-curriculum)."""
    ends = mini_batch_ends(len(samples), count)
    return [samples[start:end] for start, end in zip([0] + ends, ends)]


def later_passes(per_rank: list[list[TrainSample]], orders: list[list[list[int]]], mini_batches: int,
                 token_budget: int) -> list[list[tuple[list[int], StepTotals]]]:
    """The updates of further passes over a planned step, samples staying on their rank (GAE's advantages are
    computed there; veRL too shuffles each rank's own share). Each pass's `orders` hold every rank's order of its
    samples, cut into `mini_batches` contiguous near-equal slices; the i-th slices of every rank make one update,
    left out when no rank has a sample in it. Per rank: (indices into its samples, that update's totals)."""
    plans: list[list[tuple[list[int], StepTotals]]] = [[] for _ in per_rank]
    for order in orders:
        cuts = [[o[round(i * len(o) / mini_batches):round((i + 1) * len(o) / mini_batches)]
                 for i in range(mini_batches)] for o in order]
        for i in range(mini_batches):
            picked = [[mine[j] for j in cut[i]] for mine, cut in zip(per_rank, cuts)]
            if not any(picked):
                continue
            totals = StepTotals(tokens=sum(s.trained_tokens for p in picked for s in p),
                                sequences=sum(len(p) for p in picked),
                                micro_batches=max(len(pack_micro_batches(p, token_budget)) for p in picked))
            for plan, cut in zip(plans, cuts):
                plan.append((cut[i], totals))
    return plans


def plan_step(samples: list[TrainSample], world_size: int, token_budget: int):
    """Each rank's samples, and the totals every rank needs to normalise its share of the step."""
    per_rank = split_across_ranks(samples, world_size)
    micro_batches = max(len(pack_micro_batches(s, token_budget)) for s in per_rank)
    totals = StepTotals(tokens=sum(s.trained_tokens for s in samples), sequences=len(samples),
                        micro_batches=micro_batches)
    return per_rank, totals


@dataclass
class MicroBatch:
    """Right-padded tensors. Per-token tensors are [B, L-1]: position t predicts input_ids[:, t+1]."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor  # float; 1.0 where the predicted token is a trained response token (not a tool's)
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    proximal_logprobs: torch.Tensor | None  # None: the weights have not moved since the step began
    returns: torch.Tensor | None = None  # trainer.advantage=gae: the critic's targets ...
    old_values: torch.Tensor | None = None  # ... and the values its clip is centred on

    def to(self, device) -> "MicroBatch":
        return MicroBatch(*(None if t is None else t.to(device) for t in vars(self).values()))


def collate(samples: list[TrainSample]) -> MicroBatch:
    """An empty list gives one row with no response tokens: a padding micro-batch adding zero gradient."""
    rows = samples or [TrainSample([PAD_ID, PAD_ID], 2, 0.0, [], [])]
    width = max(s.num_tokens for s in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    response_mask = torch.zeros(len(rows), width - 1)
    advantages = torch.zeros(len(rows), width - 1)
    behaviour = torch.zeros(len(rows), width - 1)
    versions = torch.zeros(len(rows), width - 1, dtype=torch.long)
    known = samples and all(s.proximal_logprobs is not None for s in samples)
    proximal = torch.zeros(len(rows), width - 1) if known else None
    critic = samples and all(s.returns is not None for s in samples)
    returns, old_values = (torch.zeros(len(rows), width - 1) for _ in range(2)) if critic else (None, None)
    for i, s in enumerate(rows):
        input_ids[i, :s.num_tokens] = torch.tensor(s.input_ids)
        attention_mask[i, :s.num_tokens] = 1  # even on the padding row: a fully masked row gives NaN
        response = slice(s.prompt_len - 1, s.num_tokens - 1)
        response_mask[i, response] = 1.0 if s.mask is None else torch.tensor(s.mask, dtype=torch.float)
        advantages[i, response] = s.advantage if s.token_advantages is None else torch.tensor(s.token_advantages)
        behaviour[i, response] = torch.tensor(s.logprobs)
        versions[i, response] = torch.tensor(s.versions, dtype=torch.long)
        if proximal is not None:
            proximal[i, response] = torch.tensor(s.proximal_logprobs)
        if returns is not None:
            returns[i, response], old_values[i, response] = torch.tensor(s.returns), torch.tensor(s.values)
    return MicroBatch(input_ids, attention_mask, response_mask, advantages, behaviour, versions, proximal, returns,
                      old_values)
