"""The reason task (a reasoning model's length shape): lognormal difficulty, demonstrations that work a share of
the chain and jump to the answer, the full chain past the cap for a stated share; its config; and the prompts'
share of the trained tokens a run reports at its first and last step."""
import statistics
from pathlib import Path

import pytest

from rlsys.bench import summarise_run
from rlsys.cli import main
from rlsys.config import ConfigError
from rlsys.data.reason_tasks import CAP_SHARE, CAP_TERMS, MAX_TERMS, MEDIAN_TERMS, WORKED_MEDIAN
from rlsys.data.synthetic import make_split
from rlsys.reward.registry import final_value
from rlsys.startup import load_config
from rlsys.step_stats import StepStats
from rlsys.types import Completion, Group, Prompt, ScoredSample

CONFIG = Path(__file__).parent.parent / "configs" / "emulated_h100_7b_reason.yaml"
CAP = 128  # the config's rollout.max_new_tokens


def terms_of(text: str) -> list[tuple[str, int]]:
    """`r x1k0=` -> [("x", 1), ("k", 0)], checking the letters are distinct and the digits below 3."""
    body = text[len("r "):-1]
    terms = [(body[i], int(body[i + 1])) for i in range(0, len(body), 2)]
    assert len({x for x, _ in terms}) == len(terms) and all(x.isalpha() and d < 3 for x, d in terms), text
    return terms


def worked(terms) -> str:
    """An independent worked answer: each letter and digit with the sum so far, mod 3."""
    return ", ".join(f"{x}{d}={sum(e for _, e in terms[:i + 1]) % 3}" for i, (x, d) in enumerate(terms))


def steps_worked(terms, answer: str) -> int:
    """How many terms `answer` works before it jumps (all of them if it does not)."""
    full = worked(terms)
    if answer == full:
        return len(terms)
    chain, _, jump = answer.rpartition(" =") if " =" in answer else ("", "", answer[1:])
    assert full.startswith(chain) and jump == str(sum(d for _, d in terms) % 3), answer  # a prefix, the right sum
    return chain.count("=")


@pytest.fixture(scope="module")
def prompts():
    return make_split("reason", "train", 4000, seed=0)


def test_an_answer_works_a_share_of_the_chain_then_jumps_to_the_sum(prompts):
    shares = []
    for p in prompts:
        terms = terms_of(p.text)
        shares.append(steps_worked(terms, p.answer) / len(terms))
        assert final_value(worked(terms), p.answer) == 1.0  # the full chain is right
        wrong = str((sum(d for _, d in terms) + 1) % 3)
        assert final_value(p.answer.rpartition("=")[0] + "=" + wrong, p.answer) == 0.0
    full = sum(s == 1 for s in shares) / len(shares)
    assert 0.1 < full < 0.4 and sum(s == 0 for s in shares) / len(shares) < 0.02  # few direct answers
    assert abs(statistics.median(shares) - WORKED_MEDIAN) < 0.1


def test_difficulty_is_right_skewed_with_the_stated_share_past_the_cap(prompts):
    terms = sorted(len(terms_of(p.text)) for p in prompts)
    median, p90 = statistics.median(terms), terms[int(0.9 * len(terms))]
    assert median == MEDIAN_TERMS and statistics.mean(terms) > median and p90 >= 2 * median, (median, p90)
    assert terms[0] == 1 and terms[-1] == MAX_TERMS
    past_cap = [n for n in terms if len(worked([("x", 0)] * n)) > CAP]
    assert min(past_cap) == CAP_TERMS and len(worked([("x", 0)] * (CAP_TERMS - 1))) <= CAP
    assert abs(len(past_cap) / len(terms) - CAP_SHARE) < 0.014  # 5 standard errors of 4,000 draws


def test_a_hard_prompts_answers_spread_in_proportion_and_its_right_answer_is_long(prompts):
    """The worked length grows with the difficulty and spreads right-skewed within it; a hard prompt's answer is
    right when worked through (many characters) or by a jump that guesses the sum of the terms left."""
    by_terms: dict[int, list[int]] = {}
    for p in prompts:
        by_terms.setdefault(len(terms_of(p.text)), []).append(len(p.answer))
    easy, hard = by_terms[3] + by_terms[4], [n for t in range(12, 16) for n in by_terms[t]]
    assert statistics.median(hard) > 3 * statistics.median(easy)
    hard.sort()
    p10, median, p90 = hard[len(hard) // 10], statistics.median(hard), hard[9 * len(hard) // 10]
    assert p90 - median > median - p10 and statistics.mean(hard) > median, (p10, median, p90)  # right-skewed
    for p in prompts:
        terms = terms_of(p.text)
        if len(terms) >= 12:  # worked through, the right answer is at least 70 characters
            assert len(worked(terms)) >= 70 and final_value(worked(terms), p.answer) == 1.0


def test_the_prompt_is_short_and_a_few_percent_of_the_emulated_tokens(prompts):
    cfg = load_config(str(CONFIG), [])
    assert all(len(p.text) <= cfg.data.max_prompt_tokens for p in prompts)
    k, per_prompt = cfg.emulate.tokens_per_token, cfg.emulate.prompt_tokens
    share = per_prompt / (per_prompt + k * statistics.mean(len(p.answer) for p in prompts))
    assert 0.02 < share < 0.1, share
    assert statistics.mean(len(p.text) for p in prompts) < statistics.mean(len(p.answer) for p in prompts)


def test_splits_are_seeded():
    assert make_split("reason", "train", 200, seed=1) == make_split("reason", "train", 200, seed=1)
    assert make_split("reason", "train", 200, seed=1) != make_split("reason", "train", 200, seed=2)


def test_the_config_loads_and_checks(capsys):
    cfg = load_config(str(CONFIG), [])
    assert (cfg.data.task, cfg.reward.fn, cfg.emulate.prompt_tokens) == ("reason", "final_value", 128)
    assert main(["check", str(CONFIG)]) == 0
    assert "a valid config" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="reward.fn=final_value"):
        load_config(str(CONFIG), ["reward.fn=exact_match"])


def completion(prompt_tokens: int, tokens: int) -> Completion:
    return Completion("r", "p", [1] * prompt_tokens, [2] * tokens, [0.0] * tokens, [0] * tokens, "stop")


def test_a_run_reports_the_prompts_share_of_its_trained_tokens():
    """A step logs its samples' mean prompt length; the run's prompt share at its first and last step is the
    emulated model's, a prompt standing for emulate.prompt_tokens where that is set, k tokens a token otherwise."""
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=lambda window: [])
    steps = []
    for prompt_tokens, tokens in ((10, 30), (20, 70)):
        samples = [ScoredSample(completion(prompt_tokens, n), 1.0) for n in (tokens - 5, tokens + 5)]
        row = stats.close_rollout([Group(Prompt("p", "", ""), samples)])
        assert row["prompt_length/mean"] == prompt_tokens
        steps.append({**row, **stats.step_totals(), "time_s": len(steps) + 1.0})
    plain = summarise_run(steps, target=1.0)
    assert (plain["prompt_share_first"], plain["prompt_share_last"]) == (10 / 40, 20 / 90)
    clock = {"emulate/tokens_per_token": 64, "emulate/prompt_tokens": 128}
    emulated = summarise_run([clock, *steps], target=1.0)
    assert (emulated["prompt_share_first"], emulated["prompt_share_last"]) == (128 / (128 + 64 * 30),
                                                                               128 / (128 + 64 * 70))
    scaled = summarise_run([{**clock, "emulate/prompt_tokens": None}, *steps], target=1.0)
    assert scaled["prompt_share_first"] == pytest.approx(10 / 40)  # k scales prompt and response alike
