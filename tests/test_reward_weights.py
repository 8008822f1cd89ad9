"""Rewards of several functions with weights (reward.fn a list, reward.weights; TRL's reward_funcs and
reward_weights): the reward is the weighted sum, each part is reported on its own, bad lists are refused by name."""
import pytest

from rlsys.config import ConfigError, OverlongConfig, RewardConfig
from rlsys.reward import RewardPool, register_reward
from rlsys.reward.registry import exact_match, reward_parts, score, score_parts, well_formed
from rlsys.startup import load_config
from rlsys.step_stats import reward_part_means
from rlsys.types import Completion, ScoredSample


@register_reward("test_length_share")
def length_share(response: str, answer: str) -> float:
    """A graded part: the response's length over 10, capped at 1 (raises on "boom")."""
    if response == "boom":
        raise ValueError("no length for you")
    return min(len(response) / 10, 1.0)


RESPONSES = [("7", "7"), ("7\n8", "7"), ("12345", "12345"), ("", "3"), ("a long wrong answer", "4")]


def expected(response: str, answer: str, weights=(1.0, 0.2, -0.5)) -> tuple[float, dict]:
    values = {"exact_match": exact_match(response, answer), "format": well_formed(response, answer),
              "test_length_share": length_share(response, answer)}
    return sum(w * v for w, v in zip(weights, values.values())), values


def three_parts(**kw) -> RewardConfig:
    return RewardConfig(fn=["exact_match", "format", "test_length_share"], weights=[1.0, 0.2, -0.5], **kw)


@pytest.mark.parametrize("response, answer", RESPONSES)
def test_the_reward_is_the_weighted_sum_of_the_parts(response, answer):
    cfg = three_parts()
    reward, values = score_parts(cfg, reward_parts(cfg), response, answer, num_tokens=3)
    want, want_values = expected(response, answer)
    assert values == want_values
    assert reward == pytest.approx(want, abs=1e-12)
    assert score(cfg, response, answer, 3) == reward


def test_weights_default_to_one_each_and_the_overlong_penalty_adds_once():
    cfg = RewardConfig(fn=["exact_match", "format"], overlong=OverlongConfig(enabled=True, max_len=96, cache_len=16))
    assert score(cfg, "7", "7", num_tokens=88) == pytest.approx(2.0 - 0.5)  # 1 + 1, then the penalty of 88 tokens


def test_a_single_function_keeps_its_reward():
    assert score(RewardConfig(fn="exact_match"), "7", "7", 1) == 1.0
    assert score(RewardConfig(fn="exact_match", weights=[0.25]), "7", "7", 1) == 0.25


def test_the_pool_scores_each_part_and_reports_it(ray_cluster):
    pool = RewardPool(three_parts(num_workers=2))
    try:
        items = [(f"k{i}", response, answer, 3) for i, (response, answer) in enumerate(RESPONSES)]
        items.append(("bad", "boom", "4", 3))
        results = pool.score_all(items)
    finally:
        pool.shutdown()
    for result, (response, answer) in zip(results, RESPONSES):
        want, want_values = expected(response, answer)
        assert result.error is None and result.parts == want_values
        assert result.reward == pytest.approx(want, abs=1e-12)
    bad = results[-1]
    assert bad.reward == 0.0 and bad.parts is None  # one failing part fails the sample, naming the part
    assert bad.error == "reward.fn part test_length_share raised ValueError: no length for you"


def test_a_single_function_reports_no_parts(ray_cluster):
    pool = RewardPool(RewardConfig(fn="exact_match"))
    try:
        assert pool.score_all([("k", "7", "7", 1)])[0].parts is None
    finally:
        pool.shutdown()


def test_each_part_is_logged_as_its_mean_over_the_samples_that_train():
    def sample(parts):
        return ScoredSample(Completion("r", "p", [], [1], [0.0], [0], "stop"), 0.0, None, parts)
    samples = [sample({"exact_match": 1.0, "format": 1.0}), sample({"exact_match": 0.0, "format": 1.0}),
               sample(None),  # the fallback: no parts
               sample({"exact_match": 1.0, "format": 0.0})]
    assert reward_part_means(samples) == {"reward/exact_match/mean": pytest.approx(2 / 3),
                                          "reward/format/mean": pytest.approx(2 / 3)}
    assert reward_part_means([sample(None)]) == {}


@pytest.mark.parametrize("overrides, message", [
    (["reward.fn=[exact_match,format]", "reward.weights=[1.0]"],
     r"reward.weights: .*1 weight\(s\) for the 2 part\(s\) of reward.fn \(exact_match, format\)"),
    (["reward.fn=exact_match", "reward.weights=[1.0,2.0]"], r"reward.weights: .*2 weight\(s\) for the 1 part"),
    (["reward.fn=[exact_match,formt]"], r"reward.fn: unknown reward function 'formt'"),
    (["reward.fn=[format,format]"], r"reward.fn names format twice"),
    (["reward.fn=[]"], r"reward.fn is an empty list"),
    (["reward.fn=[exact_match,reward_model]"], r"reward.fn names reward_model: set reward.model.path"),
    (["reward.model.path=somewhere"], r"reward.model.path is set but reward.fn does not name reward_model"),
])
def test_bad_parts_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_task_scored_on_its_final_value_takes_it_among_parts():
    cfg = load_config(None, ["data.task=cot_sum", "reward.fn=[final_value,format]", "reward.weights=[1.0,0.1]"])
    assert cfg.reward.names == ["final_value", "format"]
    with pytest.raises(ConfigError, match="reward.fn=final_value"):
        load_config(None, ["data.task=cot_sum", "reward.fn=[exact_match,format]"])
