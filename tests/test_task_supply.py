"""A task that cannot supply the prompts the config asks for is refused by `rlsys check` and `rlsys train` in one
line naming data.train_size (or eval_size) and the task, before anything starts, not minutes into the run."""
from rlsys.cli import main

FEW = "def few(rng):\n    n = rng.randint(1, 30)\n    return f'echo {n}=', str(n)\n"  # 30 distinct prompts


def task(tmp_path) -> str:
    path = tmp_path / "few.py"
    path.write_text(FEW)
    return f"{path}:few"


def test_check_and_train_refuse_a_task_with_fewer_distinct_prompts_than_train_size(tmp_path, capsys):
    spec = task(tmp_path)
    for command in (["check"], ["train", f"output_dir={tmp_path / 'run'}"]):
        assert main([*command, f"data.task={spec}", "data.train_size=100", "data.eval_size=2"]) == 2
        err = capsys.readouterr().err
        assert f"data.train_size: data.task={spec!r} gave 30 distinct prompts in 11000 draws, fewer than " \
               "data.train_size=100; lower data.train_size" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run's folder, Ray or a model


def test_the_eval_split_is_counted_apart_from_the_train_split(tmp_path, capsys):
    spec = task(tmp_path)
    assert main(["check", f"data.task={spec}", "data.train_size=26", "data.eval_size=5"]) == 2
    err = capsys.readouterr().err
    assert "data.eval_size: " in err and "gave 4 distinct prompts not in the train split" in err, err
    assert main(["check", f"data.task={spec}", "data.train_size=25", "data.eval_size=5"]) == 0
