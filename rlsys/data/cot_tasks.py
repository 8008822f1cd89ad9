"""The `cot_count` task family: long-CoT RL's length shape on the CPU, where answers lengthen as the policy learns.

`cot xkqm=` asks how many letters the prompt holds, counted in letters (a = 1, b = 2, ...). It may be answered
directly, `d`, or worked as a chain of thought, each letter copied with the count so far, `x=a, k=b, q=c, m=d`;
reward.fn=final_value scores the value after the last "=", so both are right. A tiny model cannot count many
letters at once, but each step of the chain is a copy (the letter after the last one copied) and a successor (the
letter after the last count), which it learns, so the longer answer is right more often, as a chain of thought is.
The train split demonstrates the chain for CHAIN_SHARE of its prompts, drawn independently of the prompt: the warm
start leaves a policy that mostly answers directly (short, right on short prompts) and sometimes works the chain,
so a group's samples vary in length and RL lengthens the answers.

The letter count is 2 + a Pareto(1.0) draw, at most MAX_LETTERS (distinct letters): the worked chain's median is
about 18 characters (tokens, with the character tokenizer), its p90 about 58, and the longest, CHAIN_CAP_SHARE
(1/24, about 4%) of prompts, is 128 characters: with its eos, past a 128-token response cap
(configs/emulated_h100_7b_cot.yaml), as the longest chains of thought reach RL's length cap.
"""
from __future__ import annotations

import random
import string

from rlsys.data.synthetic import TASKS

CHAIN_SHARE = 0.3  # train prompts whose answer is the worked chain; the rest answer directly
MAX_LETTERS = len(string.ascii_lowercase)
CHAIN_CAP_SHARE = 1 / (MAX_LETTERS - 2)  # P(Pareto(1.0) >= 24): the share of prompts drawn with MAX_LETTERS


def chain(letters: str) -> str:
    """`x=a, k=b, ...`: each letter with the count so far, as a letter."""
    return ", ".join(f"{letter}={count}" for letter, count in zip(letters, string.ascii_lowercase))


@TASKS.register("cot_count")
def letter_count(rng: random.Random) -> tuple[str, str]:
    k = min(MAX_LETTERS, 2 + int(rng.paretovariate(1.0)))
    letters = "".join(rng.sample(string.ascii_lowercase, k))
    worked = rng.random() < CHAIN_SHARE  # drawn for every prompt, so the eval split's draws match the train's
    return f"cot {letters}=", chain(letters) if worked else string.ascii_lowercase[k - 1]
