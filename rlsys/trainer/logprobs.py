"""Log-probs of the sampled tokens, computed so the full-vocabulary logits never exist at once.

At 32k tokens x 152k vocabulary one fp32 copy of the logits is ~20 GB. `head_logprobs` applies the LM
head to `chunk` tokens at a time and keeps only each token's log-prob and entropy; its backward
recomputes each chunk's logits (the way fused linear-cross-entropy kernels do), so the extra memory is
a few [chunk, vocab] fp32 tensors, whatever the sequence length. Both outputs carry a gradient (the
entropy's for trainer.entropy_coeff); one that the loss does not use costs no backward work.

Tokens are scored as the engines record them: log softmax(logits / T), and with top_p < 1 under the
top-p nucleus renormalised (vLLM's processed log-probs; the rule of the built-in engine: a token is in
the nucleus while the mass ranked strictly above it is below top_p). A token outside the trainer's
nucleus (its logits differ from the engine's by rounding) is scored as if the nucleus held it too:
never -inf into the loss, and the same value wherever trainer and engine agree. How tokens are scored is
fixed for a run: one `Scoring`, handed to the trainer as it is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Scoring:
    """How the trainer scores tokens, as the engines sampled them: at `temperature`, in the `top_p` nucleus."""
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of(cls, rollout) -> Scoring:
        """A run's, from its RolloutConfig: greedy sampling is scored at temperature 1, with no nucleus (as vLLM)."""
        greedy = rollout.temperature == 0
        return cls(1.0 if greedy else rollout.temperature, 1.0 if greedy else rollout.top_p)


def temperature_divisor(temperature: float) -> float:
    """What logits are divided by: T, where T <= 0 (greedy) counts as 1."""
    return temperature if temperature > 0 else 1.0


def scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    """fp32 logits / T (`temperature_divisor`)."""
    return logits.float() / temperature_divisor(temperature)


def nucleus_floor(scaled: Tensor, top_p: float) -> Tensor:
    """[N, 1]: the smallest scaled logit inside each row's top-p nucleus."""
    ranked = scaled.sort(-1, descending=True).values
    probs = ranked.softmax(-1)
    inside = (probs.cumsum(-1) - probs) < top_p  # the mass ranked above each token
    return ranked.gather(-1, inside.sum(-1, keepdim=True) - 1)


def scored_logits(scaled: Tensor, targets: Tensor, floor: Tensor | None) -> Tensor:
    """The logits of the distribution tokens are scored under: -inf outside the nucleus, bar the target."""
    if floor is None:
        return scaled
    outside = (scaled < floor).scatter_(-1, targets[:, None], False)
    return scaled.masked_fill(outside, float("-inf"))


def score(logits: Tensor, targets: Tensor, scoring: Scoring) -> tuple[Tensor, Tensor | None]:
    """(scored logits, nucleus floor or None) of rows of logits [N, V]: one scaling and masking, from which
    both the targets' log-probs and the entropy are read."""
    scaled = scaled_logits(logits, scoring.temperature)
    floor = None
    if scoring.top_p < 1:
        with torch.no_grad():
            floor = nucleus_floor(scaled, scoring.top_p)
    return scored_logits(scaled, targets, floor), floor


def target_logprobs(z: Tensor, targets: Tensor) -> Tensor:
    """log softmax(z) at each row's target."""
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


def entropy_of(z: Tensor) -> Tensor:
    """The entropy of softmax(z) per row; -inf logits (outside the nucleus) add nothing."""
    probs = z.softmax(-1)
    return -torch.special.xlogy(probs, probs).sum(-1)


def entropy_logit_grad(z: Tensor, grad_entropy: Tensor) -> Tensor:
    """g * dH / dz for rows z [N, V] and g [N, 1]: dH / dz_j = -p_j (log p_j + H); 0 where p_j = 0."""
    probs = z.softmax(-1)
    p_log_p = torch.special.xlogy(probs, probs)
    entropy = -p_log_p.sum(-1, keepdim=True)
    return (p_log_p + probs * entropy).mul_(-grad_entropy)


def token_logprobs(logits: Tensor, input_ids: Tensor, scoring: Scoring, with_entropy: bool = False):
    """Log-prob of each next token, [B, L-1], from full logits [B, L, V] (no chunking: for small models
    and checks). With `with_entropy`, also the entropy at each position."""
    B, L, V = logits.shape
    rows, targets = logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1)
    z, _ = score(rows, targets, scoring)
    logprobs = target_logprobs(z, targets).view(B, L - 1)
    if not with_entropy:
        return logprobs
    return logprobs, entropy_of(z).view(B, L - 1)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(log-probs, entropy) [N] of `targets` under `hidden` [N, H] @ head, `chunk` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scoring, chunk):
        logprobs, entropy, floors = [], [], []
        for rows in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[rows:rows + chunk], weight, bias)
            mine = targets[rows:rows + chunk]
            z, floor = score(logits, mine, scoring)
            logprobs.append(target_logprobs(z, mine))
            entropy.append(entropy_of(z))
            floors.append(floor)
        floors = torch.cat(floors) if scoring.top_p < 1 else None
        ctx.save_for_backward(hidden, weight, bias, targets, floors)
        ctx.temperature, ctx.chunk = scoring.temperature, chunk
        ctx.set_materialize_grads(False)  # an output the loss does not use comes back as None: no work for it
        return torch.cat(logprobs), torch.cat(entropy)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, floors = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None  # fp32 sum over chunks
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        scale = temperature_divisor(ctx.temperature)
        for rows in range(0, hidden.shape[0], ctx.chunk):
            h, mine = hidden[rows:rows + ctx.chunk], targets[rows:rows + ctx.chunk]
            floor = None if floors is None else floors[rows:rows + ctx.chunk]
            z = scored_logits(scaled_logits(F.linear(h, weight, bias), ctx.temperature), mine, floor)
            # d logprob / d logit = (onehot(target) - softmax over the scored distribution) / T
            grad_z = torch.zeros_like(z)
            if grad_logprobs is not None:
                g = grad_logprobs[rows:rows + ctx.chunk, None]
                grad_z = z.softmax(-1).mul_(-g).scatter_add_(-1, mine[:, None], g)
            if grad_entropy is not None:  # + the entropy's
                grad_z.add_(entropy_logit_grad(z, grad_entropy[rows:rows + ctx.chunk, None]))
            grad_logits = grad_z.div_(scale).to(weight.dtype)
            if want_hidden:
                grad_hidden[rows:rows + ctx.chunk] = grad_logits @ weight
            if want_weight:
                grad_weight += grad_logits.T @ h
            if want_bias:
                grad_bias += grad_logits.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def head_logprobs(hidden: Tensor, head: torch.nn.Linear, input_ids: Tensor, scoring: Scoring,
                  chunk: int) -> tuple[Tensor, Tensor]:
    """(log-probs, entropy) of each next token, [B, L-1], from the final hidden states [B, L, H]."""
    B, L, H = hidden.shape
    logprobs, entropy = ChunkedHeadLogprobs.apply(hidden[:, :-1].reshape(-1, H), head.weight, head.bias,
                                                  input_ids[:, 1:].reshape(-1), scoring, chunk)
    return logprobs.view(B, L - 1), entropy.view(B, L - 1)
