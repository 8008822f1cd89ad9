import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlsys.config import DataConfig
from rlsys.data import DataError, filter_long_prompts, length_stats, load_datasets, read_prompts
from rlsys.data.synthetic import MAX_ANSWER_CHARS, MIX, TASKS, make_split, synthetic_splits
from rlsys.models.tiny import build_char_tokenizer


def solve(text: str) -> str:
    """An independent solver for the built-in families: what a correct policy must answer."""
    op, rest = text.rstrip("=").split(" ", 1)
    if op == "rep":
        k, unit = rest.split(" ")
        return unit * int(k)
    if op == "rev":
        return rest[::-1]
    if op == "srt":
        return "".join(sorted(rest))
    if op == "add":
        a, b = rest.split("+")
        return str(int(a) + int(b))
    raise AssertionError(f"unknown family in {text!r}")


# --- synthetic tasks ---------------------------------------------------------------------------

def test_splits_are_deterministic_by_seed():
    assert make_split("synthetic", "train", 50, seed=3) == make_split("synthetic", "train", 50, seed=3)
    assert make_split("synthetic", "train", 50, seed=3) != make_split("synthetic", "train", 50, seed=4)


def test_eval_is_held_out_and_prompts_are_distinct():
    train, evals = synthetic_splits("synthetic", 2000, 300, seed=0)
    train_texts, eval_texts = {p.text for p in train}, {p.text for p in evals}
    assert len(train_texts) == 2000 and len(eval_texts) == 300
    assert not train_texts & eval_texts
    assert [p.uid for p in evals[:2]] == ["eval-0", "eval-1"] and [p.index for p in train[:2]] == [0, 1]


def test_every_answer_is_what_an_independent_solver_says():
    train, evals = synthetic_splits("synthetic", 2000, 200, seed=1)
    assert {p.data_source for p in train} == set(MIX)
    for p in train + evals:
        assert p.answer == solve(p.text), p
        assert p.text.startswith(p.data_source + " ")


@pytest.mark.parametrize("family", TASKS.names())
def test_each_family_can_be_chosen_alone(family):
    prompts = make_split(family, "train", 20, seed=0)
    assert {p.data_source for p in prompts} == {family}


def test_answer_lengths_are_heavy_tailed_and_fit_the_response_limit():
    train, _ = synthetic_splits("synthetic", 4000, 10, seed=0)
    stats = length_stats(train)
    assert stats["ratio"] >= 5, stats
    assert stats["max"] <= MAX_ANSWER_CHARS < 96  # room for eos within max_new_tokens
    assert length_stats(train, build_char_tokenizer()) == stats  # one token per character


def test_load_datasets_synthetic_family_and_unknown_task():
    train, evals = load_datasets(DataConfig(task="rev", train_size=30, eval_size=5))
    assert len(train) == 30 and len(evals) == 5 and {p.data_source for p in train} == {"rev"}
    with pytest.raises(DataError, match="data.task: unknown task 'nope'.*rep"):
        load_datasets(DataConfig(task="nope"))


def test_filter_long_prompts_counts_what_it_drops():
    train = make_split("synthetic", "train", 100, seed=0)
    kept, dropped = filter_long_prompts(train, build_char_tokenizer(), max_tokens=9)
    assert dropped == sum(len(p.text) > 9 for p in train) > 0
    assert len(kept) + dropped == 100 and all(len(p.text) <= 9 for p in kept)


# --- dataset files -----------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


VERL_ROWS = [
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
     "reward_model": {"style": "rule", "ground_truth": "2"}, "data_source": "gsm"},
    {"prompt": "rev ab=", "answer": "ba"},
    {"prompt": "add 2+3=", "reward_model": {"ground_truth": 5}},
]


def test_jsonl_with_verl_columns(tmp_path):
    prompts = read_prompts(write_jsonl(tmp_path / "mathy.jsonl", VERL_ROWS + [""]), split="eval")
    assert [(p.text, p.answer, p.data_source) for p in prompts] == [
        ("1+1?", "2", "gsm"), ("rev ab=", "ba", "mathy"), ("add 2+3=", "5", "mathy")]
    assert [p.uid for p in prompts] == ["eval-0", "eval-1", "eval-2"]


def test_parquet_with_nested_ground_truth_and_message_lists(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "rep 2 a="}], "reward_model": {"ground_truth": "aa"},
             "data_source": "syn"},
            {"prompt": [{"role": "user", "content": "srt ba="}], "reward_model": {"ground_truth": "ab"},
             "data_source": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    prompts = read_prompts(tmp_path / "train.parquet")
    assert [(p.text, p.answer, p.data_source) for p in prompts] == [
        ("rep 2 a=", "aa", "syn"), ("srt ba=", "ab", "train")]


def test_chat_messages_use_the_tokenizer_chat_template_when_it_has_one(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    prompts = read_prompts(write_jsonl(tmp_path / "d.jsonl", VERL_ROWS[:1]), tokenizer=tok)
    assert prompts[0].text == "<system>be brief\n<user>1+1?\n<assistant>"


def test_files_task_reads_both_paths_or_holds_out_eval(tmp_path):
    rows = [{"prompt": f"rev {w}=", "answer": w[::-1]} for w in ["ab", "abc", "abcd", "xyz", "qr", "st"]]
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    train, evals = load_datasets(DataConfig(task="files", train_path=str(path), eval_path=str(path)))
    assert len(train) == len(evals) == 6 and evals[0].uid == "eval-0"
    train, evals = load_datasets(DataConfig(task="files", train_path=str(path), eval_size=2))
    assert len(train) == 4 and len(evals) == 2 and not {p.text for p in train} & {p.text for p in evals}
    assert [p.uid for p in train] == [f"train-{i}" for i in range(4)] and evals[1].index == 1
    with pytest.raises(DataError, match="data.train_path must be set"):
        load_datasets(DataConfig(task="files"))
    with pytest.raises(DataError, match="cannot spare data.eval_size=6"):
        load_datasets(DataConfig(task="files", train_path=str(path), eval_size=6))


GOOD = {"prompt": "rev ab=", "answer": "ba"}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    (["a", "list"], "line 2: a row must be an object"),
    ({"answer": "1"}, "line 2: missing 'prompt'"),
    ({"prompt": "  ", "answer": "1"}, "line 2: 'prompt' is empty"),
    ({"prompt": 7, "answer": "1"}, "line 2: 'prompt' must be a string or a list of chat messages, got int"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "line 2: 'prompt' message 0 must be an object"),
    ({"prompt": [{"role": "system", "content": "x"}], "answer": "1"}, "line 2: 'prompt' has no message with role"),
    ({"prompt": "q"}, "line 2: missing the answer"),
    ({"prompt": "q", "reward_model": {"style": "rule"}}, "line 2: missing 'reward_model.ground_truth'"),
    ({"prompt": "q", "reward_model": "5"}, "line 2: 'reward_model' must be an object, got str"),
    ({"prompt": "q", "answer": ["1", "2"]}, "line 2: 'answer' must be a string or a number, got list"),
    ({"prompt": "q", "reward_model": {"ground_truth": True}}, "'reward_model.ground_truth' must be a string"),
    ({"prompt": "q", "answer": "1", "data_source": 3}, "line 2: 'data_source' must be a string, got int"),
    ({"prompt": "q", "answer": "1", "extra_info": [1]}, "line 2: 'extra_info' must be an object, got list"),
])
def test_bad_jsonl_row_names_file_line_and_problem(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_bad_parquet_row_names_file_and_row(tmp_path):
    rows = [{"prompt": "rev ab=", "reward_model": {"ground_truth": "ba"}},
            {"prompt": "rev cd=", "reward_model": {"ground_truth": None}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet, row 1: missing 'reward_model.ground_truth'"):
        read_prompts(tmp_path / "bad.parquet")


def test_parquet_extra_info_reaches_the_prompt_and_must_be_json(tmp_path):
    """extra_info is passed to a veRL-style reward function and saved in checkpoints with the open prompts."""
    import datetime

    rows = [{"prompt": "rev ab=", "answer": "ba", "extra_info": {"index": 0, "split": "train"}},
            {"prompt": "rev cd=", "answer": "dc", "extra_info": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "good.parquet")
    assert [p.extra_info for p in read_prompts(tmp_path / "good.parquet")] == [{"index": 0, "split": "train"}, None]
    rows[1]["extra_info"] = {"index": 1, "split": "train", "seen": datetime.datetime(2025, 1, 1)}
    rows[0]["extra_info"]["seen"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dated.parquet")
    with pytest.raises(DataError, match=r"dated.parquet, row 1: 'extra_info' must hold only JSON values"):
        read_prompts(tmp_path / "dated.parquet")


def test_empty_missing_unreadable_and_unsupported_files_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl: the file is empty"):
        read_prompts(tmp_path / "empty.jsonl")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: the file is empty"):
        read_prompts(tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"nope.jsonl: dataset file not found"):
        read_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"junk.parquet: not a readable parquet file"):
        read_prompts(tmp_path / "junk.parquet")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"d.csv: unsupported dataset file type '.csv'"):
        read_prompts(tmp_path / "d.csv")


def test_rep_long_answers_reach_hundreds_of_tokens_with_a_heavy_tail():
    """The GPU workload's family: median tens of tokens, p99 over 10x it, a few percent past a 512-token cap."""
    from rlsys.data.long_tasks import LONG_ANSWER_CHARS

    train = make_split("rep_long", "train", 4000, seed=0)
    stats = length_stats(train, build_char_tokenizer())
    assert 40 <= stats["median"] <= 100 and stats["ratio"] >= 10 and stats["max"] <= LONG_ANSWER_CHARS, stats
    assert 0.01 <= sum(len(p.answer) > 512 for p in train) / len(train) <= 0.1
    for p in train[:50]:  # the prompt says the answer: k copies of the unit
        k, unit = p.text[len("rep "):-1].split(" ")
        assert p.answer == unit * int(k)
