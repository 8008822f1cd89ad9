"""The `rep_long` task family: `rep`'s repetitions with answers hundreds to thousands of tokens long, for a GPU.

`rep 37 ab=` -> `abab...ab` (37 times). k is 16 times a Pareto(1.1) draw: the median answer is about 60
characters (tokens, with the character tokenizer), the p99 about 1,050 (17x the median), the longest
LONG_ANSWER_CHARS, and a few percent pass a 512-token response cap, as long chains of thought do in RL on
math. The default families stay under the CPU's 96-token limit; this one is for models and response caps
that a GPU runs (configs/gpu/bench_0.5b.yaml). Scored by exact match, like `rep`: a long answer is the hard one.
"""
from __future__ import annotations

import random

from rlsys.data.synthetic import TASKS, repetitions

LONG_ANSWER_CHARS = 2000
SCALE, SHAPE = 16, 1.1  # k = SCALE x Pareto(SHAPE)


@TASKS.register("rep_long")
def repeat_unit_long(rng: random.Random) -> tuple[str, str]:
    return repetitions(rng, lambda: max(1, int(SCALE * rng.paretovariate(SHAPE))), LONG_ANSWER_CHARS)
