"""The `math` task family: fraction sums worked step by step, scored on the final value.

`math 1/2+1/3-1/4=` -> `5/6-1/4=7/12`: each step folds the first two terms into one value in lowest
terms and carries the rest along, so the answer grows with the term count, which is heavy-tailed (half
the prompts have two terms, a quarter five or more): a round has real stragglers, as with long chains of
thought. Score it with reward.fn=math_verify, which compares the value after the last "=": "14/24" or
"\\frac{7}{12}" there is just as right, however the steps are written. Not in the default mix.
"""
from __future__ import annotations

import random
from fractions import Fraction

from rlsys.data.synthetic import MAX_ANSWER_CHARS, TASKS


def as_answer(value: Fraction) -> str:
    """Lowest terms; an integer has no denominator."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def worked_sum(terms: list[str], ops: list[str]) -> str:
    """`a+b-c` -> `v1-c=v2`: one step per operator, the terms not yet folded in carried along."""
    steps, value = [], Fraction(terms[0])
    for i, op in enumerate(ops):
        value = value + Fraction(terms[i + 1]) if op == "+" else value - Fraction(terms[i + 1])
        steps.append(as_answer(value) + "".join(o + t for o, t in zip(ops[i + 1:], terms[i + 2:])))
    return "=".join(steps)


@TASKS.register("math")
def fraction_sum(rng: random.Random) -> tuple[str, str]:
    while True:  # redraw rather than clip, so no spike at the length limit
        k = 1 + int(rng.paretovariate(1.0))
        terms = [f"{rng.randint(1, 9)}/{rng.randint(2, 9)}" for _ in range(k)]
        ops = [rng.choice("+-") for _ in range(k - 1)]
        answer = worked_sum(terms, ops)
        if len(answer) <= MAX_ANSWER_CHARS:
            return "math " + terms[0] + "".join(o + t for o, t in zip(ops, terms[1:])) + "=", answer
