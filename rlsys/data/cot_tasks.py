"""The `cot_sum` task family: long-CoT RL's length shape on the CPU, where answers lengthen as the policy learns.

`cot x1k0q2=` asks for the sum mod 3 of the digits, each under a letter of its own. It may be answered directly,
`0`, or worked as a chain of thought, each letter and digit copied with the sum so far, `x1=1, k0=1, q2=0`;
reward.fn=final_value scores the value after the last "=", so both are right. A sum mod 3 of many digits at once
is parity's harder cousin, which a small transformer does not compute in one pass, but each step of the chain is a
copy (the prompt's next pair) and a 9-entry sum of neighbours, so the longer answer is right more often, as a
chain of thought is. (A count of letters was tried first: the tiny model counts them directly, from the
prompt's length, so nothing favoured the chain.) The train split demonstrates the chain for CHAIN_SHARE of its
prompts, drawn independently of the prompt: the warm start leaves a policy that mostly answers directly (short,
right on short prompts or by chance) and sometimes works the chain, so a group's samples vary in length and RL
lengthens the answers.

The term count is 2 + a Pareto(1.0) draw, at most MAX_TERMS: the worked chain's median is about 16 characters
(tokens, with the character tokenizer), its p90 about 70, and the longest, CHAIN_CAP_SHARE (1/20, 5%) of
prompts, is 130 characters: past a 128-token response cap (configs/emulated_h100_7b_cot.yaml), cut there, as the
longest chains of thought are cut by RL's length cap.
"""
from __future__ import annotations

import random
import string

from rlsys.data.synthetic import TASKS

CHAIN_SHARE = 0.3  # train prompts whose answer is the worked chain; the rest answer directly
MAX_TERMS = 22
CHAIN_CAP_SHARE = 1 / (MAX_TERMS - 2)  # P(Pareto(1.0) >= 20): the share of prompts drawn with MAX_TERMS


def chain(terms: list[tuple[str, int]]) -> str:
    """`x1=1, k0=1, ...`: each letter and digit with the sum so far, mod 3."""
    steps, total = [], 0
    for letter, d in terms:
        total = (total + d) % 3
        steps.append(f"{letter}{d}={total}")
    return ", ".join(steps)


@TASKS.register("cot_sum")
def digit_sum(rng: random.Random) -> tuple[str, str]:
    k = min(MAX_TERMS, 2 + int(rng.paretovariate(1.0)))
    terms = [(letter, rng.randrange(3)) for letter in rng.sample(string.ascii_lowercase, k)]
    prompt = "cot " + "".join(f"{letter}{d}" for letter, d in terms) + "="
    worked = rng.random() < CHAIN_SHARE  # drawn for every prompt, so the eval split's draws match the train's
    return prompt, chain(terms) if worked else str(sum(d for _, d in terms) % 3)
