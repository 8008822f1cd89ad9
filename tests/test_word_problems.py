"""The word_problems task family and data.chat_template (fast: no model, no Ray)."""
import re

import pytest

from rlsys.config import DataConfig
from rlsys.data import DataError, load_datasets
from rlsys.data.files import chat_text
from rlsys.data.synthetic import TASKS, make_split, synthetic_splits
from rlsys.data.word_problems import INSTRUCTION
from rlsys.models.tiny import build_char_tokenizer
from rlsys.reward.registry import math_verify


def solve(text: str) -> int:
    """An independent solver: which template by its wording, then the numbers in the order they appear."""
    n = [int(x) for x in re.findall(r"\d+", text)]
    rules = [("more. How many", lambda: n[0] + n[1]), ("eats or loses", lambda: n[0] - n[1]),
             ("bags with", lambda: n[0] * n[1]), ("boxes with", lambda: n[0] * n[1] - n[2]),
             ("dollar bill", lambda: n[2] - n[0] * n[1]), ("equally among", lambda: (n[0] + n[1]) // n[2]),
             ("km every hour", lambda: n[0] * n[1]), ("pages are left", lambda: n[0] - n[1] * n[2]),
             ("per hour", lambda: n[0] * (n[1] + n[2])), ("rows of chairs", lambda: n[0] * n[1] - n[2])]
    for phrase, answer in rules:
        if phrase in text:
            return answer()
    raise AssertionError(f"no template matches {text!r}")


def test_registered_and_deterministic_by_seed():
    assert "word_problems" in TASKS
    assert make_split("word_problems", "train", 30, seed=1) == make_split("word_problems", "train", 30, seed=1)
    assert make_split("word_problems", "train", 30, seed=1) != make_split("word_problems", "train", 30, seed=2)


def test_answers_are_whole_numbers_that_math_verify_accepts_and_rejects():
    train, evals = synthetic_splits("word_problems", 1000, 100, seed=0)
    assert not {p.text for p in train} & {p.text for p in evals}
    for p in train + evals:
        value = solve(p.text)
        assert value >= 0 and p.answer == str(value), p.text
        assert p.text.endswith(INSTRUCTION) and p.data_source == "word_problems"
    for p in train[:40]:  # math-verify (the reward) against the independently computed value
        assert math_verify(f"So the answer is \\boxed{{{solve(p.text)}}}.", p.answer) == 1.0
        assert math_verify(f"So the answer is \\boxed{{{solve(p.text) + 1}}}.", p.answer) == 0.0


def test_every_template_is_drawn():
    texts = [p.text for p in make_split("word_problems", "train", 400, seed=0)]
    for phrase in ["more. How many", "eats or loses", "bags with", "boxes with", "dollar bill", "equally among",
                   "km every hour", "pages are left", "per hour", "rows of chairs"]:
        assert any(phrase in t for t in texts), phrase


def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def test_chat_template_renders_every_prompt_as_a_user_message():
    cfg = DataConfig(task="word_problems", train_size=5, eval_size=3, chat_template=True)
    train, evals = load_datasets(cfg, chat_tokenizer())
    plain_train, _ = load_datasets(DataConfig(task="word_problems", train_size=5, eval_size=3))
    assert [p.text for p in train] == [f"<user>{p.text}\n<assistant>" for p in plain_train]
    assert [p.answer for p in train] == [p.answer for p in plain_train] and len(evals) == 3
    with pytest.raises(DataError, match="data.chat_template is true but the model's tokenizer has no chat"):
        load_datasets(cfg, build_char_tokenizer())


class BosTokenizer:
    """A tokenizer that adds BOS itself, with a template that writes BOS too (as Llama 3's does)."""
    bos_token, bos_token_id = "<s>", 7

    def __init__(self, adds_bos: bool):
        self.adds_bos = adds_bos

    def apply_chat_template(self, messages, tools, tokenize, add_generation_prompt):
        return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def __call__(self, text):
        return {"input_ids": ([7] if self.adds_bos else []) + [ord(c) for c in text]}


def test_chat_text_never_gives_two_bos_tokens():
    messages = [{"role": "user", "content": "hi"}]
    assert chat_text(BosTokenizer(adds_bos=True), messages) == "[user]hi[assistant]"
    assert chat_text(BosTokenizer(adds_bos=False), messages) == "<s>[user]hi[assistant]"
