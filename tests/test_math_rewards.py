"""The `math` task family (worked fraction sums, scored on the final value by math_verify) and the
after-round reward baseline."""
import itertools
import random
import re
from fractions import Fraction

import ray

from rlsys.config import DataConfig, RewardConfig
from rlsys.data import TASKS, load_datasets
from rlsys.reward.pool import RewardPool
from rlsys.reward.registry import exact_match, math_verify

from helpers import unscored


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


def test_after_round_holds_training_samples_until_the_round_ends(ray_cluster):
    pool = RewardPool(RewardConfig(fn="math_verify", after_round=True))
    try:
        pool.submit("a", "22/24", "11/12", 3)
        pool.submit("b", "1/6", "-1/6", 3)
        assert unscored(pool) == 2 and not pool.refs()  # nothing sent to the workers yet
        # Evaluation is never held back, and leaves the held samples where they are.
        assert [r.reward for r in pool.score_all([("eval", "0.5", "1/2", 1)])] == [1.0]
        assert not pool.refs()
        pool.end_round()
        got = {}
        while len(got) < 2:
            ready, _ = ray.wait(pool.refs(), num_returns=1, timeout=10)
            assert ready, "no reward call finished within 10 s"
            got.update((r.key, r.reward) for r in pool.collect(ready))
        assert got == {"a": 1.0, "b": 0.0} and unscored(pool) == 0
    finally:
        pool.shutdown()
