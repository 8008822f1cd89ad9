"""Bad input gets a clear error naming where it came from, or a counted and logged decision; never a
silent change. What tests/test_data.py, test_config.py, test_reward.py and test_trainer.py (a NaN or
infinite loss) already cover is not repeated here."""
import logging
import math

import pytest

from rlsys.config import ConfigError, DataConfig, RewardConfig
from rlsys.data import DataError, load_prompts, read_prompts
from rlsys.models.tiny import build_char_tokenizer
from rlsys.reward import RewardPool, register_reward, score
from rlsys.reward.pool import worth_logging
from rlsys.reward.registry import BadReward, as_reward
from rlsys.startup import load_config


# --- datasets -------------------------------------------------------------------------------------

def test_jsonl_bytes_that_are_not_utf8_name_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "rev ab=", "answer": "ba"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl, line 2: not UTF-8 text \(invalid continuation byte"):
        read_prompts(path)


def test_prompts_over_max_prompt_tokens_are_dropped_counted_and_logged(caplog):
    cfg = DataConfig(task="rev", train_size=200, eval_size=50, max_prompt_tokens=9)  # "rev " + word + "="
    tokenizer = build_char_tokenizer()
    with caplog.at_level(logging.WARNING, logger="rlsys.data"):
        train, evals, dropped = load_prompts(cfg, tokenizer)
    assert 0 < dropped < 200 and len(train) == 200 - dropped and all(len(p.text) <= 9 for p in train + evals)
    assert f"dropped {dropped} of 200 training prompts longer than data.max_prompt_tokens=9 tokens" in caplog.text
    assert f"dropped {50 - len(evals)} of 50 eval prompts" in caplog.text and len(evals) < 50


def test_a_split_left_empty_by_max_prompt_tokens_is_refused():
    with pytest.raises(DataError, match=r"all 20 training prompts are longer than data.max_prompt_tokens=3 tokens"):
        load_prompts(DataConfig(task="rev", train_size=20, eval_size=5, max_prompt_tokens=3), build_char_tokenizer())


# --- configs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message, line", [
    ("trainer:\n  lr: 0.1\n  total_steps: many\n", "trainer.total_steps: Input should be a valid integer", 3),
    ("control:\n  sagc:\n    sizes: [4, 8]\n    deltaa: 0.1\n", "control.sagc.deltaa: unknown key", 4),
    ("control:\n  sagc:\n    sizes: [4, x]\n", "control.sagc.sizes.1: Input should be a valid integer", 3),
    ("reward:\n  fn: exact_match\n  fallback: -2\n", "reward.fallback=-2.0 must lie within reward.valid_range", 1),
], ids=["wrong_type", "misspelt_nested_key", "wrong_type_in_a_list", "fallback_outside_the_range"])
def test_a_bad_value_in_a_file_names_the_field_file_and_line(tmp_path, text, message, line):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and f"[{path}, line {line}]" in str(err.value)


# --- rewards --------------------------------------------------------------------------------------

@register_reward("test_bad_input_values")
def echo(response: str, answer: str) -> float:
    """The response is the value to return: a number, or a Python literal such as nan."""
    return float(response)


def test_rewards_outside_the_valid_range_are_refused():
    assert as_reward(-1) == -1.0 and as_reward(1.0, (-1.0, 1.0)) == 1.0
    with pytest.raises(BadReward, match=r"returned 1\.5, outside reward.valid_range \[-1, 1\]"):
        as_reward(1.5, (-1.0, 1.0))
    wide = RewardConfig(fn="test_bad_input_values", valid_range=(0, 10))
    assert score(wide, "7", "", 1) == 7.0
    with pytest.raises(BadReward, match="outside reward.valid_range"):
        score(RewardConfig(fn="test_bad_input_values"), "7", "", 1)


def test_nan_inf_and_out_of_range_rewards_get_the_fallback_counted_and_logged(ray_cluster, caplog):
    pool = RewardPool(RewardConfig(fn="test_bad_input_values", fallback=-0.5))
    try:
        items = [(value, value, "", 1) for value in ["0.5", "nan", "inf", "-inf", "1.5", "-3", "-1"]]
        with caplog.at_level(logging.WARNING, logger="rlsys.reward.pool"):
            got = {r.key: (r.reward, r.error) for r in pool.score_all(items)}
    finally:
        pool.shutdown()
    assert got.pop("0.5") == (0.5, None) and got.pop("-1") == (-1.0, None)
    assert got == {"nan": (-0.5, "returned nan"), "inf": (-0.5, "returned inf"), "-inf": (-0.5, "returned -inf"),
                   "1.5": (-0.5, "returned 1.5, outside reward.valid_range [-1, 1]"),
                   "-3": (-0.5, "returned -3.0, outside reward.valid_range [-1, 1]")}
    assert pool.errors == 5 and not any(math.isnan(r) or abs(r) > 1 for r, _ in got.values())
    for key, (_, error) in got.items():
        assert f"(sample {key}): {error}; it gets the fallback reward -0.5" in caplog.text


def test_reward_errors_are_logged_as_a_trickle_not_a_flood():
    logged = [n for n in range(1, 2001) if worth_logging(n)]
    assert logged[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30] and logged[-3:] == [900, 1000, 2000]
    assert len(logged) == 29


def test_a_key_given_twice_in_a_config_file_is_refused_with_both_lines(tmp_path):
    from rlsys.config import ConfigError
    from rlsys.startup import load_config

    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  lr: 1.0e-4\n  total_steps: 3\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 4: key 'lr' repeats the one on line 2"):
        load_config(path)
