"""The worked example examples/own_reward/: its configs load from the repository root, its data script
writes veRL parquet that rlsys reads, and its reward function scores what the data asks for."""
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.data import load_datasets
from rlsys.startup import load_config

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "own_reward"


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example's paths are relative to where rlsys runs, as documented


@pytest.mark.parametrize("config", ["gpu8.yaml", "cpu.yaml"])
def test_the_example_configs_load_with_the_users_reward_function(in_repo, config):
    from rlsys.reward.registry import reward_fn

    cfg = load_config(EXAMPLE / config)
    assert cfg.reward.fn == "examples/own_reward/my_reward.py:score" and cfg.data.task == "files"
    assert reward_fn(cfg.reward.fn)("so 3 + 4 = \\boxed{7}", "7") == 1.0


def test_the_example_data_is_read_as_verl_parquet_and_scored_by_the_example_reward(in_repo, tmp_path):
    from rlsys.reward.registry import reward_fn

    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(tmp_path)], check=True)
    cfg = load_config(EXAMPLE / "cpu.yaml", [f"data.train_path={tmp_path / 'train.parquet'}",
                                             f"data.eval_path={tmp_path / 'eval.parquet'}"])
    train, evals = load_datasets(cfg.data)  # no tokenizer: the last user message is the prompt
    assert (len(train), len(evals)) == (512, 64)
    assert train[0].data_source == "own_apples" and train[0].text.endswith("Put the final answer in \\boxed{}.")
    score = reward_fn(cfg.reward.fn)
    for p in train[:20]:
        assert score(f"She has \\boxed{{{p.answer}}} apples.", p.answer) == 1.0
        assert score(f"She has {int(p.answer) + 1} apples.", p.answer) == 0.0
    assert score("no number at all", "7") == 0.0 and score("\\boxed{7}", "seven") == 0.0


def test_the_verl_style_example_reward_scores_the_example_data_with_its_data_source(in_repo, tmp_path):
    from rlsys.reward.registry import score

    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(tmp_path)], check=True)
    cfg = load_config(EXAMPLE / "cpu.yaml", ["reward.fn=examples/own_reward/verl_reward.py:compute_score",
                                             f"data.train_path={tmp_path / 'train.parquet'}",
                                             f"data.eval_path={tmp_path / 'eval.parquet'}"])
    train, _ = load_datasets(cfg.data)
    assert train[3].extra_info == {"index": 3}
    for p in train[:20]:
        assert score(cfg.reward, f"She has \\boxed{{{p.answer}}} apples.", p.answer, 10, None, p.data_source,
                     p.extra_info) == 1.0
        assert score(cfg.reward, f"\\boxed{{{int(p.answer) + 1}}}", p.answer, 10, None, p.data_source) == 0.0
    with pytest.raises(ValueError, match="no reward for data_source 'gsm8k'"):
        score(cfg.reward, "\\boxed{7}", "7", 10, None, "gsm8k")


def test_the_own_tools_example_loads_its_tool_and_the_model_can_call_it(in_repo):
    from rlsys.tools import ToolBox

    cfg = load_config(REPO / "examples" / "own_tools" / "cpu.yaml")
    tools = ToolBox.from_config(cfg.tools)
    try:
        assert tools.names == ["calculator", "convert"]
        miles = tools.run('<tool_call>{"name": "convert", "arguments": {"value": 3, "unit": "mile", "to": "km"}}'
                          '</tool_call>')
        assert (miles.ok, miles.text) == (True, "4.82803 km")
        furlongs = tools.run('<tool_call>{"name": "convert", "arguments": {"value": 1, "unit": "furlong", "to": '
                             '"m"}}</tool_call>')
        assert not furlongs.ok and furlongs.text.startswith("error: raised ValueError: unknown unit 'furlong'")
    finally:
        tools.close()
