"""The `math` task family (worked fraction sums, scored on the final value by math_verify). The after-round
reward baseline of benchmarks/reward_overlap.py: test_end_to_end.py."""
import itertools
import random
import re
from fractions import Fraction

from rlsys.config import DataConfig
from rlsys.data import TASKS, load_datasets
from rlsys.reward.registry import exact_match, math_verify


def test_math_answers_work_the_sum_step_by_step():
    rng = random.Random(0)
    for _ in range(300):
        text, answer = TASKS.get("math")(rng)
        assert text.startswith("math ") and text.endswith("=")
        terms = re.findall(r"[-+]?\d/\d", text[5:-1])
        partial = itertools.accumulate(Fraction(t) for t in terms)
        steps = answer.split("=")
        assert len(steps) == len(terms) - 1 and len(answer) <= 90
        for step, value, left in zip(steps, list(partial)[1:], itertools.count(len(terms) - 2, -1)):
            assert re.fullmatch(r"-?\d+(/\d+)?" + r"[-+]\d/\d" * left, step)  # the value, then the rest
            assert Fraction(re.match(r"-?\d+(/\d+)?", step)[0]) == value
    train, evals = load_datasets(DataConfig(task="math", train_size=300, eval_size=50))
    assert not {p.text for p in train} & {p.text for p in evals}


def test_math_verify_scores_the_final_value_however_it_is_written():
    gold = "5/6-1/4=7/12"
    for response in (gold, "7/12", "10/12-3/12=14/24", "5/6-1/4=\\frac{7}{12}"):
        assert math_verify(response, gold) == 1.0, response
    for response in ("5/6-1/4=7/13", "5/6-1/4=", "7/12-1/4"):
        assert math_verify(response, gold) == 0.0, response
    assert exact_match("7/12", gold) == 0.0
