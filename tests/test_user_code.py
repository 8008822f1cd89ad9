"""The user's own reward function, task family and data loader, named in the config as module:function or
file.py:function (rlsys/plugins.py): imported as the config loads, refused there with the field named."""
import json
import os

import pytest

from rlsys.cli import main
from rlsys.config import ConfigError, DataConfig
from rlsys.data import DataError, load_datasets
from rlsys.startup import load_config

USER_CODE = '''
import os

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt")


def constant_reward(response, answer):
    """0.75 for anything, and one line per call naming the process that scored it."""
    with open(CALLS, "a") as f:
        f.write(f"{os.getpid()}\\n")
    return 0.75


def one_argument(response):
    return 0.0


def countdown(rng):
    n = rng.randint(2, 9)
    return f"count down from {n}:", " ".join(str(i) for i in range(n, 0, -1))


def pipe_rows(path):
    """A format of the user's own: `question|answer` lines."""
    with open(path) as f:
        for line in f:
            question, answer = line.rstrip("\\n").split("|")
            yield {"prompt": question, "answer": answer}


def verl_without_data_source(solution_str, ground_truth):
    return 0.0


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    """The user's module, in a folder that is not on sys.path: only the config names it."""
    folder = tmp_path / "my_project"
    folder.mkdir()
    path = folder / "my_code.py"
    path.write_text(USER_CODE)
    return path


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.slow
def test_a_reward_function_in_the_users_file_trains_through_the_ray_reward_actors(tmp_path, user_file, ray_cluster):
    from test_end_to_end import SMALL

    out = tmp_path / "run"
    assert main(["train", "trainer.total_steps=2", "control.eval_every=2", f"output_dir={out}",
                 f"reward.fn={user_file}:constant_reward", "reward.num_workers=2", *SMALL,
                 "rollout.eval_samples=2", "rollout.eval_greedy=true"]) == 0
    metrics = rows(out)
    steps = [r for r in metrics if "timing/train_s" in r]
    assert [r["reward/mean"] for r in steps] == [0.75, 0.75]  # exact_match would give a spread of 0s and 1s
    assert metrics[0]["eval/accuracy"] == metrics[-1]["eval/accuracy"] == 1.0  # 0.75 counts as solved
    callers = (user_file.parent / "calls.txt").read_text().split()
    # 2 steps x 16 samples, and 2 evals of 16 prompts x (2 samples + 1 greedy)
    assert len(callers) == 2 * 16 + 2 * 16 * 3
    assert str(os.getpid()) not in callers and 1 <= len(set(callers)) <= 2  # the two reward actors, not the driver


VERL_RECORDER = '''
import json, os

SEEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seen.jsonl")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """veRL's form; one line per call with what the row's fields came in as."""
    with open(SEEN, "a") as f:
        f.write(json.dumps([data_source, ground_truth, extra_info]) + "\\n")
    return {"score": 0.5, "acc": False}
'''


@pytest.mark.slow
def test_a_verl_reward_function_trains_on_a_parquets_data_source_and_extra_info(tmp_path, ray_cluster):
    """End to end: the rows' data_source and extra_info reach the reward actors with their own answer, in training
    and in evaluation alike."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_end_to_end import SMALL

    def rows(n, split):
        return [{"data_source": f"{split}_{i % 2}", "prompt": [{"role": "user", "content": f"rev {w}="}],
                 "reward_model": {"style": "rule", "ground_truth": w[::-1]}, "extra_info": {"index": i, "split": split}}
                for i, w in enumerate(["ab", "cde", "fg", "hij", "kl", "mno", "pq", "rst"][:n])]
    pq.write_table(pa.Table.from_pylist(rows(8, "train")), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(4, "test")), tmp_path / "eval.parquet")
    (tmp_path / "verl_reward.py").write_text(VERL_RECORDER)
    out = tmp_path / "run"
    assert main(["train", "trainer.total_steps=1", "control.eval_every=1", f"output_dir={out}", *SMALL,
                 "data.task=files", f"data.train_path={tmp_path / 'train.parquet'}",
                 f"data.eval_path={tmp_path / 'eval.parquet'}", f"reward.fn={tmp_path / 'verl_reward.py'}:compute_score",
                 "rollout.eval_samples=1", "rollout.eval_greedy=false"]) == 0
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    expected = {(r["data_source"], r["reward_model"]["ground_truth"], json.dumps(r["extra_info"]))
                for r in rows(8, "train") + rows(4, "test")}
    assert {(source, answer, json.dumps(info)) for source, answer, info in seen} <= expected
    assert len(seen) == 16 + 2 * 4  # one step of 4 prompts x 4 samples, two evals of 4 prompts
    assert {info["split"] for _, _, info in seen} == {"train", "test"}
    assert [r["reward/mean"] for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
            if "reward/mean" in r] == [0.5]


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:score", "reward.fn: cannot import module 'no_such_module' (No module named 'no_such_module')"),
    ("{file}:score", "reward.fn: file '{file}' has no function 'score'"),
    ("{file}:one_argument", "reward.fn: '{file}:one_argument' has the signature (response), but rlsys calls it "
                            "as fn(response, answer)"),
    ("{file}:verl_without_data_source", "reward.fn: '{file}:verl_without_data_source' has the signature "
     "(solution_str, ground_truth), but rlsys calls it as fn(data_source=..., solution_str=..., ground_truth=..., "
     "extra_info=...)"),
    ("{file}:NOT_A_FUNCTION", "reward.fn: '{file}:NOT_A_FUNCTION' is not a function (it is of type int)"),
    ("{missing}:score", "reward.fn: file '{missing}' not found"),
    (":score", "reward.fn: ':score' is neither a registered name nor 'module.path:function'"),
])
def test_a_bad_reward_spec_is_refused_as_the_config_loads(user_file, spec, message):
    names = {"file": str(user_file), "missing": str(user_file.parent / "nope.py")}
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"reward.fn={spec.format(**names)}"])
    assert message.format(**names) in str(refused.value)


def test_a_module_that_raises_as_it_imports_is_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency\n")
    with pytest.raises(ConfigError, match="reward.fn: importing .*broken.py' raised ModuleNotFoundError: "
                                          "No module named 'no_such_dependency'"):
        load_config(None, [f"reward.fn={broken}:score"])


def test_a_bad_spec_is_one_message_from_the_command_line(capsys):
    assert main(["train", "reward.fn=no_such_module:score"]) == 2
    err = capsys.readouterr().err
    assert "reward.fn: cannot import module 'no_such_module'" in err and "Traceback" not in err


def test_a_module_spec_on_the_path_works_like_a_file(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    cfg = load_config(None, ["reward.fn=my_code:constant_reward"])
    from rlsys.reward.registry import reward_fn
    assert reward_fn(cfg.reward.fn)("anything", "else") == 0.75


def test_a_task_family_of_the_users_own(user_file):
    cfg = load_config(None, [f"data.task={user_file}:countdown", "data.train_size=5", "data.eval_size=3"]).data
    train, evals = load_datasets(cfg)
    assert (len(train), len(evals)) == (5, 3)
    for p in train + evals:
        n = int(p.text.split()[-1].rstrip(":"))
        assert p.answer == " ".join(str(i) for i in range(n, 0, -1))
    with pytest.raises(ConfigError, match=r"data.task: .*constant_reward' has the signature \(response, answer\), "
                                          r"but rlsys calls it as fn\(rng\)"):
        load_config(None, [f"data.task={user_file}:constant_reward"])


def test_a_loader_of_the_users_own_reads_its_format_into_checked_rows(user_file, tmp_path):
    data = tmp_path / "questions.txt"
    data.write_text("2+2|4\n3+3|6\n5+5|10\n")
    cfg = load_config(None, ["data.task=files", f"data.train_path={data}", "data.eval_size=1",
                             f"data.loader={user_file}:pipe_rows"]).data
    train, evals = load_datasets(cfg)
    assert sorted(p.answer for p in train + evals) == ["10", "4", "6"] and len(evals) == 1

    data.write_text("2+2|4\n|6\n")
    with pytest.raises(DataError, match="questions.txt, row 1 of data.loader: 'prompt' is empty"):
        load_datasets(cfg)
    data.write_text("no separator\n")
    with pytest.raises(DataError, match="questions.txt: data.loader raised ValueError"):
        load_datasets(cfg)
    with pytest.raises(ConfigError, match="data.loader reads data.train_path, so it needs data.task=files"):
        load_config(None, [f"data.loader={user_file}:pipe_rows"])


def test_specs_are_not_mistaken_for_registered_names():
    assert DataConfig(task="math").task == "math"  # built-in names import nothing
    with pytest.raises(DataError, match="data.task: unknown task 'nope'"):
        load_datasets(DataConfig(task="nope"))
