"""The `reason` task family: a reasoning model's length shape on the CPU, for the emulated comparisons.

`r x1k0q2=` asks, as cot_sum does (rlsys/data/cot_tasks.py), for the sum mod 3 of the digits, and a chain of
thought works it term by term, `x1=1, k0=1, q2=0`; reward.fn=final_value scores the value after the last "=".
What differs is the shape of the samples a warm-started policy draws:

- Difficulty is the term count n, lognormal (median MEDIAN_TERMS), so a few prompts are long and most are short.
- Each demonstration works a lognormal share of its prompt's terms (median WORKED_MEDIAN), then jumps to the
  answer, `x1=1, k0=1 =2`; a share of 1 or more works them all. The policy learns to stop after a share of the
  chain, so one prompt's samples spread right-skewed, in proportion to its difficulty: no spike of direct answers
  beside a hump, as cot_sum's policy has. A jump guesses the sum of the terms left, so short answers to hard
  prompts are mostly wrong (right 1 time in 3 by chance): RL lengthens the answers, as in long-CoT RL.
- The full chain of n terms is 6n - 2 characters (tokens, with the character tokenizer): past a 128-token
  response cap (configs/emulated_h100_7b_reason.yaml) from n = 22, CAP_SHARE of prompts, cut there and wrong.
- The prompt is 2n + 3 characters, under the response; its emulated length is set on its own
  (emulate.prompt_tokens), as a reasoning model's prompt is a few hundred tokens whatever its response's length.
"""
from __future__ import annotations

import math
import random
import string

from rlsys.data.cot_tasks import chain
from rlsys.data.synthetic import TASKS

MEDIAN_TERMS, TERMS_SIGMA = 7, 0.6  # n = round(lognormal), in [1, MAX_TERMS]
MAX_TERMS = 26  # one distinct letter a term
WORKED_MEDIAN, WORKED_SIGMA = 0.6, 0.5  # the share of its terms a demonstration works: lognormal, at most 1
CAP_TERMS = 22  # the fewest terms whose full chain (6n - 2 characters) passes the 128-token cap
CAP_SHARE = 0.5 * math.erfc(math.log((CAP_TERMS - 0.5) / MEDIAN_TERMS) / (TERMS_SIGMA * math.sqrt(2)))  # ~3%


def terms_count(rng: random.Random) -> int:
    return min(MAX_TERMS, max(1, round(rng.lognormvariate(math.log(MEDIAN_TERMS), TERMS_SIGMA))))


def answer(terms: list[tuple[str, int]], worked: int) -> str:
    """The chain of the first `worked` terms, then, unless that is all of them, a jump to the sum: ` =2`."""
    if worked >= len(terms):
        return chain(terms)
    return f"{chain(terms[:worked])} ={sum(d for _, d in terms) % 3}".lstrip()


@TASKS.register("reason")
def reasoned_sum(rng: random.Random) -> tuple[str, str]:
    n = terms_count(rng)
    terms = [(letter, rng.randrange(3)) for letter in rng.sample(string.ascii_lowercase, n)]
    worked = round(n * rng.lognormvariate(math.log(WORKED_MEDIAN), WORKED_SIGMA))
    return "r " + "".join(f"{letter}{d}" for letter, d in terms) + "=", answer(terms, worked)
