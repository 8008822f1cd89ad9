"""What a warm start says while it builds the tiny model: a progress bar, an accuracy that means what it says,
and that a user's own answers are what it trains on."""
import json

import pytest

from rlsys import models
from rlsys.config import Config, DataConfig, ModelConfig, ToolsConfig, WarmStartConfig
from rlsys.models import prepare_model

SMALL = dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=128)


def small(tmp_path, data: DataConfig, **sections) -> Config:
    return Config(model=ModelConfig(**SMALL, cache_dir=str(tmp_path / "cache"),
                                    warm_start=WarmStartConfig(steps=3, batch_size=8)), data=data, **sections)


def test_the_warm_start_shows_its_steps_and_loss_as_training_does(tmp_path, capsys):
    prepare_model(small(tmp_path, DataConfig(train_size=40, eval_size=4)))
    captured = capsys.readouterr()
    assert "warm start: 100%" in captured.err and "3/3" in captured.err and "loss=" in captured.err, captured.err
    assert "eval greedy accuracy " in captured.out and "%" in captured.out


@pytest.mark.parametrize("task, tools", [("tool_arith", ToolsConfig(fns=["calculator"])),
                                         ("guess_number", ToolsConfig(env="rlsys.data.tool_tasks:GuessNumber"))])
def test_a_task_answered_through_tools_gets_no_exact_match_accuracy_that_would_read_zero(tmp_path, capsys, task, tools):
    path = prepare_model(small(tmp_path, DataConfig(task=task, train_size=40, eval_size=4), tools=tools))
    out = capsys.readouterr().out
    assert "eval greedy accuracy not measured: answers come through tools (the run's step-0 eval has it)" in out
    assert json.loads((path / models.BUILD_INFO).read_text())["warm_start"]["eval_greedy_accuracy"] is None


def test_a_warm_start_on_the_users_files_says_it_trains_on_their_answers(tmp_path, capsys):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    prepare_model(small(tmp_path, DataConfig(task="files", train_path=str(rows), eval_size=4)))
    assert (f"warm start: fine-tuning the tiny model on the answers of {rows} (model.warm_start.steps=3; 0 skips it)"
            in capsys.readouterr().out)
