"""The `cot_sum` task family: long-CoT RL's length shape on the CPU, where answers lengthen as the policy learns.

`cot a3b5c8d2=` asks for the digits' sum mod 10. It may be answered directly, `8`, or worked as a chain of thought,
one step per digit with its running total, `a3=3 b5=8 c8=6 d2=8`; reward.fn=final_value scores the value after
the last "=", so both are right. A tiny model rarely sums many digits at once, but each step of the chain is one
lookup (the tag's digit, by copying) and one small sum, so the longer answer is right more often, as a chain of
thought is. The train split demonstrates the chain for CHAIN_SHARE of its prompts, drawn independently of the
prompt: the warm start leaves a policy that mostly answers directly (short, often wrong) and sometimes works the
chain, so a group's samples vary in length and RL lengthens the answers.

The digit count is 3 + a Pareto(1.0) draw, at most MAX_DIGITS (one tag per letter): the worked chain's median is
about 24 characters (tokens, with the character tokenizer), its p90 about 65, and the longest, CHAIN_CAP_SHARE
(1/23, about 4%) of prompts, is 129 characters: past a 128-token response cap (configs/emulated_h100_7b_cot.yaml),
cut there and wrong, as the longest chains of thought are cut by RL's length cap.
"""
from __future__ import annotations

import random
import string

from rlsys.data.synthetic import TASKS

CHAIN_SHARE = 0.2  # train prompts whose answer is the worked chain; the rest answer directly
MAX_DIGITS = len(string.ascii_lowercase)
CHAIN_CAP_SHARE = 1 / (MAX_DIGITS - 3)  # P(Pareto(1.0) >= 23): the share of prompts drawn with MAX_DIGITS


def chain(digits: list[int]) -> str:
    """`a3=3 b5=8 ...`: each digit under its tag, with the running total mod 10."""
    steps, total = [], 0
    for tag, d in zip(string.ascii_lowercase, digits):
        total = (total + d) % 10
        steps.append(f"{tag}{d}={total}")
    return " ".join(steps)


@TASKS.register("cot_sum")
def digit_sum(rng: random.Random) -> tuple[str, str]:
    k = min(MAX_DIGITS, 3 + int(rng.paretovariate(1.0)))
    digits = [rng.randrange(10) for _ in range(k)]
    prompt = "cot " + "".join(f"{tag}{d}" for tag, d in zip(string.ascii_lowercase, digits)) + "="
    worked = rng.random() < CHAIN_SHARE  # drawn for every prompt, so the eval split's draws match the train's
    return prompt, chain(digits) if worked else str(sum(digits) % 10)
