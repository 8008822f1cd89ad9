import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import kill_and_wait

from rlsys.config import OverlongConfig, RewardConfig
from rlsys.reward import REWARDS, RewardPool, overlong_penalty, register_reward, score
from rlsys.reward.registry import BadReward, as_reward


@register_reward("test_faulty")
def faulty(response: str, answer: str) -> float:
    """Exact match, except for responses that name a fault to act out."""
    if response == "raise":
        raise ValueError("bad input")
    if response == "busy":
        while True:
            pass
    if response == "sleep":
        time.sleep(60)
    if response == "gil":  # catastrophic backtracking: the regex engine never releases the GIL
        re.match(r"(a+)+$", "a" * 64 + "b")
    if response == "crash":
        os._exit(1)
    if response == "nap":
        time.sleep(0.3)
        return 1.0
    if response == "nan":
        return float("nan")
    if response == "str":
        return "abc"
    return float(response == answer)


# -- built-in functions --------------------------------------------------------------------------

def test_exact_match():
    fn = REWARDS.get("exact_match")
    assert fn(" 42\n", "42") == 1.0
    assert fn("41", "42") == 0.0
    assert fn("", "42") == 0.0


@pytest.mark.parametrize("response, answer, expected", [
    ("\\boxed{0.5}", "1/2", 1.0),
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("$1+x^2$", "x^2+1", 1.0),  # bare LaTeX answer
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("no number here", "2", 0.0),
    ("\\boxed{2}", "", 0.0),
])
def test_math_verify_equivalences(response, answer, expected):
    assert REWARDS.get("math_verify")(response, answer) == expected


def test_math_verify_works_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which fails outside the main thread; they are off.
    with ThreadPoolExecutor(1) as runner:
        assert runner.submit(REWARDS.get("math_verify"), "\\boxed{0.5}", "1/2").result() == 1.0


def test_format():
    fn = REWARDS.get("format")
    assert fn("42", "") == 1.0
    assert fn("  the answer is 7 \n", "") == 1.0
    assert fn("", "") == 0.0
    assert fn("   \n", "") == 0.0
    assert fn("line one\nline two", "") == 0.0


@pytest.mark.parametrize("num_tokens, expected", [
    (0, 0.0), (80, 0.0), (84, -0.25), (88, -0.5), (96, -1.0), (97, -1.0), (500, -1.0),
])
def test_overlong_penalty(num_tokens, expected):
    assert overlong_penalty(num_tokens, max_len=96, cache_len=16) == pytest.approx(expected)


def test_score_adds_overlong_penalty_only_when_enabled():
    off = RewardConfig(fn="exact_match")
    on = RewardConfig(fn="exact_match", overlong=OverlongConfig(enabled=True, max_len=96, cache_len=16))
    assert score(off, "7", "7", num_tokens=88) == 1.0
    assert score(on, "7", "7", num_tokens=88) == pytest.approx(0.5)
    assert score(on, "8", "7", num_tokens=200) == -1.0


def test_as_reward_refuses_junk():
    assert as_reward(1) == 1.0 and as_reward(True) == 1.0
    for junk, message in [(float("nan"), "returned nan"), (math.inf, "returned inf"),
                          ("abc", "returned 'abc'"), (None, "returned None")]:
        with pytest.raises(BadReward, match=re.escape(message)):
            as_reward(junk)


def test_register_reward_by_name():
    assert REWARDS.get("test_faulty") is faulty
    with pytest.raises(ValueError, match="registered twice"):
        register_reward("test_faulty")(faulty)
    with pytest.raises(KeyError, match="exact_match"):
        REWARDS.get("no_such_reward")


def test_pool_refuses_an_unknown_function():
    with pytest.raises(KeyError, match="no_such_reward"):
        RewardPool(RewardConfig(fn="no_such_reward"))


# -- the pool ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def faulty_pool(ray_cluster):
    pool = RewardPool(RewardConfig(fn="test_faulty", num_workers=2, timeout_s=0.5, fallback=-1.0))
    yield pool
    pool.shutdown()


def test_pool_streams_many_items(ray_cluster):
    pool = RewardPool(RewardConfig(fn="exact_match", num_workers=2))
    try:
        pool.submit([(f"k{i}", str(i % 7), "3", 5) for i in range(300)])
        assert pool.unscored() == 300
        results, rounds = {}, 0
        while pool.unscored():
            ready, _ = ray_cluster.wait(pool.refs(), num_returns=1, timeout=10)
            assert ready, "no reward call finished within 10 s"
            rounds += 1
            results.update((r.key, r) for r in pool.collect(ready))
        assert len(results) == 300 and pool.errors == 0
        assert all(r.reward == float(int(k[1:]) % 7 == 3) and r.error is None for k, r in results.items())
        assert 1 < rounds < 300  # streamed in several calls, each carrying several items
    finally:
        pool.shutdown()


def test_pool_score_all_with_math_verify(ray_cluster):
    pool = RewardPool(RewardConfig(fn="math_verify", num_workers=1))
    try:
        items = [("a", "\\boxed{0.5}", "1/2", 3), ("b", "\\boxed{3}", "4", 3),
                 ("c", "$\\frac{2}{4}$", "0.5", 3)]
        assert [(r.key, r.reward, r.error) for r in pool.score_all(items)] == [
            ("a", 1.0, None), ("b", 0.0, None), ("c", 1.0, None)]
    finally:
        pool.shutdown()


def test_score_all_refuses_while_other_items_are_in_flight(ray_cluster):
    """score_all would take the others' results and drop them: it refuses, and the others come back through
    collect(). (Evaluation mid-run goes through the controller's pump: test_end_to_end.py.)"""
    pool = RewardPool(RewardConfig(fn="exact_match", num_workers=1))
    try:
        pool.submit([("train-1", "ab", "ab", 2)])
        with pytest.raises(RuntimeError, match="score_all: 1 other items are being scored"):
            pool.score_all([("eval-1", "x", "y", 1)])
        got = pool.collect([])
        while not got:
            ready, _ = ray.wait(pool.refs(), num_returns=1, timeout=5)
            got = pool.collect(ready)
        assert [(r.key, r.reward) for r in got] == [("train-1", 1.0)]
    finally:
        pool.shutdown()


def test_faults_get_the_fallback_and_the_pool_keeps_scoring(faulty_pool):
    errors, restarts = faulty_pool.errors, faulty_pool.restarts
    items = [("ok1", "5", "5", 1), ("raise", "raise", "", 1), ("nan", "nan", "", 1), ("str", "str", "", 1),
             ("busy", "busy", "", 1), ("sleep", "sleep", "", 1), ("ok2", "5", "6", 1)]
    got = {r.key: r for r in faulty_pool.score_all(items)}
    assert (got["ok1"].reward, got["ok1"].error) == (1.0, None)
    assert (got["ok2"].reward, got["ok2"].error) == (0.0, None)
    assert got["raise"].error == "raised ValueError: bad input"
    assert got["nan"].error == "returned nan"
    assert got["str"].error == "returned 'abc'"
    assert got["busy"].error == got["sleep"].error == "timeout after 0.5s"
    assert all(got[k].reward == -1.0 for k in ["raise", "nan", "str", "busy", "sleep"])
    assert faulty_pool.errors - errors == 5
    assert faulty_pool.restarts - restarts == 2  # the two workers stuck in a hung call were replaced
    after = faulty_pool.score_all([(f"k{i}", str(i), "2", 1) for i in range(4)])
    assert [r.reward for r in after] == [0.0, 0.0, 1.0, 0.0] and faulty_pool.errors - errors == 5


def test_a_worker_hung_holding_the_gil_is_killed_from_the_driver(faulty_pool):
    # The worker cannot report this timeout itself; the driver's deadline catches it. With both
    # workers napping, the next three items queue up and "gil" likely shares a call with "1":
    # then both are retried alone and only "gil" gets the fallback.
    errors, restarts = faulty_pool.errors, faulty_pool.restarts
    items = [("n1", "nap", "", 1), ("n2", "nap", "", 1), ("one", "1", "1", 1), ("gil", "gil", "", 1),
             ("two", "2", "2", 1)]
    got = {r.key: (r.reward, r.error) for r in faulty_pool.score_all(items)}
    assert got.pop("gil") == (-1.0, "timeout after 0.5s")
    assert set(got.values()) == {(1.0, None)}
    assert faulty_pool.errors - errors == 1 and faulty_pool.restarts - restarts >= 1


def test_a_killed_worker_is_replaced_and_its_items_resubmitted(faulty_pool, ray_cluster):
    restarts = faulty_pool.restarts
    faulty_pool.submit([("a", "nap", "", 1), ("b", "nap", "", 1)])  # two workers, two items: one each
    for worker in faulty_pool.workers:
        ray_cluster.kill(worker)
    results, deadline = [], time.monotonic() + 90  # new workers start in seconds, even on a loaded machine
    while faulty_pool.unscored():
        replaced = faulty_pool.restarts - restarts
        assert time.monotonic() < deadline, (f"{faulty_pool.unscored()} items unscored 90 s after their workers were "
                                             f"killed: the workers were not replaced ({replaced} restarts)")
        ready, _ = ray_cluster.wait(faulty_pool.refs(), num_returns=1, timeout=5)
        results += faulty_pool.collect(ready) + faulty_pool.reap()
    assert sorted((r.key, r.reward, r.error) for r in results) == [("a", 1.0, None), ("b", 1.0, None)]
    assert faulty_pool.restarts - restarts == 2


def test_a_node_lost_with_an_idle_worker_on_it_costs_no_item_a_fallback(ray_cluster):
    """A lost node takes a busy worker and an idle one. The busy one's item is retried once, alone: it must
    wait for a worker that answers, not go to the idle one, which is dead too but shows it only when called
    (the item would die a second time and get the fallback). Both deaths are settled before the pool hears
    of either, so no timing decides the outcome."""
    pool = RewardPool(RewardConfig(fn="test_faulty", num_workers=2, timeout_s=5.0, fallback=-1.0))
    try:
        pool.submit([("item", "nap", "", 1)])  # one worker busy, the other idle
        (busy,) = {call.worker for call in pool._calls.values()}
        assert pool._idle == {1 - busy}
        for worker in pool.workers:  # the node is gone: every actor on it is dead before the pool looks
            kill_and_wait(worker)
        results = []
        while pool.unscored():
            ready, _ = ray_cluster.wait(pool.refs(), num_returns=1, timeout=30)
            assert ready, "the pool stalled"
            results += pool.collect(ready) + pool.reap()
        assert [(r.key, r.reward, r.error) for r in results] == [("item", 1.0, None)]
        assert pool.restarts == 2 and pool.errors == 0
    finally:
        pool.shutdown()


def test_an_item_that_kills_its_worker_twice_gets_the_fallback(faulty_pool):
    errors = faulty_pool.errors
    [crashed, fine] = faulty_pool.score_all([("crash", "crash", "", 1), ("ok", "1", "1", 1)])
    assert crashed.reward == -1.0 and crashed.error.startswith("worker died")
    assert (fine.reward, fine.error) == (1.0, None)
    assert faulty_pool.errors - errors == 1


VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """veRL's form: the row's fields decide the reward, so a field dropped on the way shows."""
    if solution_str != ground_truth:
        return 0.0
    return {"score": extra_info["weight"] * (1 if data_source == "plus" else -1), "unused": "kept out"}
'''


def test_a_verl_reward_function_gets_the_parquet_rows_fields_through_the_ray_pool(tmp_path, ray_cluster):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlsys.data.files import read_prompts
    from rlsys.types import Completion, reward_item

    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"weight": i / 10}}
            for i, source in enumerate(["plus", "minus", "plus", "minus"], start=1)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "rewards.py").write_text(VERL_REWARD)
    prompts = read_prompts(tmp_path / "train.parquet")
    assert [(p.data_source, p.extra_info) for p in prompts][:2] == [("plus", {"weight": 0.1}),
                                                                    ("minus", {"weight": 0.2})]
    pool = RewardPool(RewardConfig(fn=f"{tmp_path / 'rewards.py'}:compute_score", num_workers=2))
    try:
        items = [reward_item(Completion(f"r{i}", p.uid, [], [], [], [], "stop", text=p.answer), p)
                 for i, p in enumerate(prompts)]
        items.append(reward_item(Completion("wrong", "train-0", [], [], [], [], "stop", text="no"), prompts[0]))
        got = [(r.key, r.reward, r.error) for r in pool.score_all(items)]
    finally:
        pool.shutdown()
    assert got == [("r0", 0.1, None), ("r1", -0.2, None), ("r2", 0.3, None), ("r3", -0.4, None),
                   ("wrong", 0.0, None)]


def test_a_dict_without_a_score_is_junk():
    assert as_reward({"score": 0.5, "acc": True}) == 0.5
    with pytest.raises(BadReward, match="returned a dict without a 'score' key \\(keys: acc\\)"):
        as_reward({"acc": 1.0})
