"""The cot_sum task (long-CoT RL's length shape): answers direct or worked, scored on their final value, lengths
heavy-tailed with a stated share past the cap; and the length shape a run reports at its first and last step."""
import statistics

import pytest

from helpers import SMALL
from rlsys.bench import summarise_run
from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG, ConfigError
from rlsys.control.metrics import percentile
from rlsys.data import filter_long_prompts
from rlsys.data.cot_tasks import CHAIN_CAP_SHARE, CHAIN_SHARE, MAX_TERMS, chain
from rlsys.data.synthetic import make_split
from rlsys.logger import read_jsonl
from rlsys.models.tiny import build_char_tokenizer
from rlsys.reward.registry import final_value
from rlsys.startup import load_config

CAP = 128  # configs/emulated_h100_7b_cot.yaml's rollout.max_new_tokens


def terms_of(text: str) -> list[tuple[str, int]]:
    """`cot x1k0=` -> [("x", 1), ("k", 0)], checking the letters are distinct and the digits below 3."""
    body = text[len("cot "):-1]
    terms = [(body[i], int(body[i + 1])) for i in range(0, len(body), 2)]
    assert len({x for x, _ in terms}) == len(terms) and all(x.isalpha() and d < 3 for x, d in terms), text
    return terms


def direct(terms) -> str:
    return str(sum(d for _, d in terms) % 3)


def worked(terms) -> str:
    """An independent worked answer: each letter and digit with the sum so far, mod 3."""
    return ", ".join(f"{x}{d}={sum(e for _, e in terms[:i + 1]) % 3}" for i, (x, d) in enumerate(terms))


def test_answers_are_direct_or_worked_and_either_is_right_on_its_final_value():
    prompts = make_split("cot_sum", "train", 4000, seed=0)
    chains = 0
    for p in prompts:
        terms = terms_of(p.text)
        assert p.answer in (direct(terms), worked(terms)), p
        chains += p.answer == worked(terms)
        assert final_value(direct(terms), p.answer) == final_value(worked(terms), p.answer) == 1.0
        assert final_value(worked(terms)[:CAP], p.answer) == (len(worked(terms)) <= CAP)  # cut at the cap: wrong
        assert final_value(str((int(direct(terms)) + 1) % 3), p.answer) == 0.0
    assert abs(chains / len(prompts) - CHAIN_SHARE) < 0.035  # 4.8 standard errors of 4,000 draws


def test_splits_are_seeded():
    assert make_split("cot_sum", "train", 200, seed=1) == make_split("cot_sum", "train", 200, seed=1)
    assert make_split("cot_sum", "train", 200, seed=1) != make_split("cot_sum", "train", 200, seed=2)


def test_worked_lengths_have_a_long_tail_and_the_stated_share_past_the_cap():
    prompts = make_split("cot_sum", "train", 4000, seed=0)
    lengths = sorted(len(chain(terms_of(p.text))) for p in prompts)
    median, p90 = statistics.median(lengths), lengths[int(0.9 * len(lengths))]
    assert 13 <= median <= 23 and p90 >= 3 * median, (median, p90)
    past_cap = sum(n > CAP for n in lengths) / len(lengths)
    assert past_cap == sum(len(terms_of(p.text)) == MAX_TERMS for p in prompts) / len(prompts)
    assert abs(past_cap - CHAIN_CAP_SHARE) < 0.017  # 4.9 standard errors
    kept, dropped = filter_long_prompts(prompts, build_char_tokenizer(), 64)  # data.max_prompt_tokens' default
    assert dropped == 0


def test_cot_sum_needs_the_final_value_reward():
    with pytest.raises(ConfigError, match="reward.fn=final_value"):
        load_config(None, ["data.task=cot_sum"])  # the default reward.fn=exact_match would score chains wrong
    assert load_config(None, ["data.task=cot_sum", "reward.fn=final_value"]).data.task == "cot_sum"


@pytest.mark.slow
def test_a_runs_length_shape_at_its_first_and_last_step_is_those_steps_samples(tmp_path, ray_cluster):
    """A sync run on cot_sum: the bench's length shape at the first and the last step is the shape of the samples
    that step trained (the timeline records each one's tokens and why it stopped)."""
    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "data.task=cot_sum", "reward.fn=final_value", "trainer.total_steps=3",
                 f"output_dir={out}", "control.eval_every=0", "control.save_every=0", *SMALL]) == 0
    summary = summarise_run(read_jsonl(out / "metrics.jsonl"), target=1.0)
    timeline = read_jsonl(out / "timeline.jsonl")
    for when, step in (("first", 1), ("last", 3)):
        samples = [r for r in timeline if r["step"] == step]
        assert len(samples) == 16  # 4 prompts x 4 samples (SMALL), each trained
        tokens = [r["tokens"] for r in samples]
        for q in (50, 90, 99):
            assert summary[f"length_p{q}_{when}"] == percentile(tokens, q)
        assert summary[f"length_at_cap_{when}"] == statistics.mean(r["finish_reason"] == "length" for r in samples)
