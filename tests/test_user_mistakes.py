"""What a user's slip costs: one message naming the fix, before anything starts, and nothing of theirs damaged
(a bench's earlier runs, a run folder). Ctrl-C reads as one line too."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsys.cli import how_to_go_on, main
from rlsys.config import DEFAULT_CONFIG

from helpers import SMALL

ROOT = Path(__file__).resolve().parent.parent


def one_message(err: str) -> str:
    assert "Traceback" not in err, err
    return err


# --- rlsys bench -----------------------------------------------------------------------------------------
# A workload rlsys refuses as its config loads, just after the folders are claimed: were a folder's refusal gone, a
# test fails on this one's message in seconds, not after a whole default bench (killed at 600 s, the earlier runs lost)
REFUSED_LATER = "trainer.total_steps=-3"


def test_a_second_bench_into_the_same_out_dir_is_refused_naming_the_folder_and_the_flag(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    (out_dir / "sync-r0").mkdir(parents=True)
    (out_dir / "sync-r0" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["bench", "--presets", "sync", "--out-dir", str(out_dir), REFUSED_LATER]) == 2
    err = one_message(capsys.readouterr().err)
    assert f"--out-dir {out_dir} holds an earlier bench's runs (sync-r0); choose another folder with --out-dir" in err
    assert (out_dir / "sync-r0" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # kept as it was


def test_a_bench_onto_an_earlier_report_is_refused_unless_it_tops_it_up(tmp_path, capsys):
    report = tmp_path / "bench.json"
    report.write_text('{"runs": {}}')
    argv = ["bench", "--presets", "sync", "--out-dir", str(tmp_path / "new"), "--output", str(report), REFUSED_LATER]
    assert main(argv) == 2
    err = one_message(capsys.readouterr().err)
    assert f"--output {report} holds an earlier bench's report; give another --output, or remove it" in err
    assert report.read_text() == '{"runs": {}}' and not (tmp_path / "new").exists()
    assert main(argv + ["--top-up"]) == 2  # taken: the workload's own refusal comes next
    assert "trainer.total_steps: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_zero_repeats_is_refused_by_the_option_itself(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--repeats", "0"])
    assert raised.value.code == 2
    assert "--repeats: '0': give a whole number of runs, at least 1" in one_message(capsys.readouterr().err)


def ctrl_c_as_at_a_terminal() -> None:
    """The child's SIGINT as a terminal's foreground process has it: a suite started in the background by a
    non-interactive shell ignores SIGINT, and a child inherits that, so a Ctrl-C sent before rlsys installs its
    own handler (during imports) would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_one_ctrl_c_stops_the_bench_keeps_the_finished_runs_and_compares_no_cut_one(tmp_path, ray_address):
    out_dir, report = tmp_path / "bench", tmp_path / "bench.json"
    # The tiny model trains about two more steps while the Ctrl-C lands (3 of 3 here, once): enough that it lands mid-run
    steps = 8
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsys.cli", "bench", "--presets", "sync,tail", "--repeats", "2", "--out-dir",
         str(out_dir), "--output", str(report), *SMALL, f"trainer.total_steps={steps}", "control.eval_every=0",
         f"cluster.address={ray_address}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_as_at_a_terminal)
    cut_run = out_dir / "tail-r0" / "metrics.jsonl"  # sync runs first, whole; tail is cut after its first step
    deadline = time.time() + 600
    while not (cut_run.exists() and "timing/train_s" in cut_run.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, out + err
    assert "rlsys: bench interrupted: tail-r0 was cut" in one_message(err)
    written = json.loads(report.read_text())
    assert written["interrupted"] and list(written["runs"]) == ["sync"] and len(written["runs"]["sync"]) == 1
    assert list(written["results"]) == ["sync"]  # the cut run is compared with nothing
    cut = written["cut_runs"]["tail-r0"]
    assert cut["cut"] and 1 <= cut["steps_trained"] < steps
    assert not (out_dir / "sync-r1").exists() and not (out_dir / "tail-r1").exists()  # nothing ran after it


# --- Ctrl-C during rlsys train --------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_is_one_line_that_suggests_no_resume(tmp_path, ray_address):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlsys.cli", "train", f"output_dir={run}", *SMALL,
                             f"cluster.address={ray_address}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=ctrl_c_as_at_a_terminal)
    time.sleep(3)  # importing torch and the rest: long before any step, let alone a checkpoint
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out + err
    assert "rlsys: interrupted" in one_message(err)
    assert "--resume" not in err and not (run / "checkpoints").exists()


def test_after_an_interruption_resume_is_suggested_only_where_a_checkpoint_exists(tmp_path):
    run = tmp_path / "run"
    assert how_to_go_on(str(run), "rlsys train x --resume") == (
        f"no checkpoint was written in {run}: nothing to resume; the command that started it starts it again")
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "controller.json").write_text('{"step": 4}')
    assert how_to_go_on(str(run), "rlsys train x --resume") == (
        f"`rlsys train x --resume` continues from the last checkpoint, step 4, in {run}")


def test_the_command_that_continues_a_run_is_rlsys_as_it_was_started(tmp_path, monkeypatch):
    """After `make setup` rlsys is .venv/bin/rlsys, on PATH only in an activated environment: the command printed to
    continue a run is one that works where the run was started."""
    from rlsys.cli import rlsys_command

    script = tmp_path / ".venv" / "bin" / "rlsys"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [".venv/bin/rlsys", "train", "--resume"])
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert rlsys_command() == ".venv/bin/rlsys"
    monkeypatch.setenv("PATH", str(script.parent))  # the environment activated
    assert rlsys_command() == "rlsys"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "rlsys" / "cli.py"), "train"])  # python -m rlsys.cli
    assert rlsys_command().endswith(f"{Path(sys.executable).name} -m rlsys.cli")


def test_train_refuses_a_misspelt_key_before_importing_torch_ray_or_deepspeed(tmp_path):
    """`rlsys check` refused it in 2 s, `rlsys train` in 10-36 s: it imported the trainer's libraries first."""
    script = ("import sys; from rlsys.cli import main; code = main(sys.argv[1:]); "
              "print('imported:', [m for m in ('ray', 'torch', 'deepspeed') if m in sys.modules]); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", script, "train", "trainer.totl_steps=3", f"output_dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "did you mean trainer.total_steps?" in one_message(out.stderr), out.stderr
    assert "imported: []" in out.stdout


# --- rlsys check / --dry-run / train: the files a run reads -----------------------------------------------
def rows_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("overrides, problem", [
    (["model.path=no/such/model"], "model.path: no/such/model is not a directory"),
    (["data.task=files", "data.train_path=no/such.jsonl"], "data.train_path: no/such.jsonl: dataset file not found"),
    (["data.task=files", "data.train_path=TRAIN", "data.eval_path=no/eval.jsonl"],
     "data.eval_path: no/eval.jsonl: dataset file not found"),
    (["data.task=files", "data.train_path=TRAIN", "data.eval_size=10"],
     "data.eval_size: TRAIN has 6 rows and cannot spare data.eval_size=10 for evaluation")])
def test_check_dry_run_and_train_catch_missing_files_before_anything_starts(overrides, problem, tmp_path, capsys):
    train = str(rows_file(tmp_path / "train.jsonl", 6))
    overrides = [o.replace("TRAIN", train) for o in overrides] + [f"output_dir={tmp_path / 'run'}"]
    problem = problem.replace("TRAIN", train)
    for command in (["check"], ["train", "--dry-run"]):  # refused as the run would be: exit 2, the reason first
        assert main([*command, *overrides]) == 2
        out, err = capsys.readouterr()
        assert one_message(err).startswith(f"rlsys: on this machine, a run would fail at start-up:\n  {problem}")
        assert "a valid config" not in out and "dry run" not in out
        assert main([*command, *overrides, "--other-machine"]) == 0  # a config meant for another machine's disks
        out, err = capsys.readouterr()
        assert "a valid config" in out and f"--other-machine: a run here would fail at start-up: {problem}" in err
    assert main(["train", *overrides]) == 2
    err = one_message(capsys.readouterr().err)
    assert f"rlsys: this run would fail at start-up:\n  {problem}" in err
    assert not (tmp_path / "run").exists()


def test_check_is_silent_about_files_that_are_there(tmp_path, capsys):
    train = rows_file(tmp_path / "train.jsonl", 6)
    assert main(["check", "data.task=files", f"data.train_path={train}", "data.eval_size=2"]) == 0
    assert "would fail" not in capsys.readouterr().err


# --- rlsys eval and plot on what is not a finished run ---------------------------------------------------
def test_plot_of_a_folder_without_metrics_is_one_message(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert f"rlsys: {tmp_path} has no metrics.jsonl" in one_message(capsys.readouterr().err)


def test_eval_of_a_run_stopped_before_its_export_names_its_last_checkpoint(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("output_dir: x\n")  # what a run writes first
    assert main(["eval", str(tmp_path)]) == 2
    assert f"{tmp_path} is a run folder without export/ (it was stopped before its end); it has no checkpoint" in \
        one_message(capsys.readouterr().err)
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002" / "controller.json").write_text('{"step": 2}')
    assert main(["eval", str(tmp_path)]) == 2
    assert f"evaluate its last checkpoint: rlsys eval {tmp_path / 'checkpoints' / 'step_000002'}" in \
        capsys.readouterr().err


def test_eval_of_an_export_without_its_run_config_asks_for_the_task(tmp_path, capsys):
    from rlsys.evaluate import RUN_CONFIG, task_source

    model = tmp_path / "copied"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["eval", str(model)]) == 2
    err = one_message(capsys.readouterr().err)
    assert f"{model} carries no run config" in err and "its task is unknown: name it, e.g. data.task=" in err
    assert task_source(str(model), ["data.task=tool_arith"]) == "task 'tool_arith' (data.task given)"
    (model / RUN_CONFIG).write_text(json.dumps({"data": {"task": "word_problems"}}))  # what a run's export holds
    assert task_source(str(model), []) == f"task 'word_problems' (from {model / RUN_CONFIG})"


# --- config mistakes ----------------------------------------------------------------------------------
def test_an_unknown_key_names_the_nearest_known_one(capsys):
    assert main(["check", "trainer.total_step=3", "control.sorted.mod=partial", "trainer.zzz=1"]) == 2
    err = one_message(capsys.readouterr().err)
    assert "trainer.total_step: unknown key (got 3) [command-line override]; did you mean trainer.total_steps?" in err
    assert ("control.sorted.mod: unknown key (got 'partial') [command-line override]; "
            "did you mean control.sorted.mode?") in err
    assert "trainer.zzz: unknown key (got 1) [command-line override]\n" in err  # nothing near: no guess


@pytest.mark.parametrize("config", sorted((ROOT / "configs" / "sim").glob("*.yaml")), ids=lambda p: p.name)
def test_a_simulator_config_given_to_check_says_to_simulate_it_in_one_message(config, capsys):
    assert main(["check", str(config)]) == 2
    err = one_message(capsys.readouterr().err)
    assert f"rlsys: {config} is a simulator config" in err and f"run it with `rlsys simulate {config}`" in err
    assert "unknown key" not in err and len(err.strip().splitlines()) == 2  # the message and the --traceback hint


# --- logging ------------------------------------------------------------------------------------------
def test_tensorboard_without_its_package_is_refused_as_the_config_loads(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorboard"):
        pytest.skip("tensorboard is installed here")
    assert main(["train", "logging.tensorboard=true", "--dry-run", f"output_dir={tmp_path}"]) == 2
    err = one_message(capsys.readouterr().err)
    assert "logging.tensorboard: the tensorboard package is not installed: install the `logging` extra" in err


def test_wandb_without_a_key_or_an_offline_mode_is_refused_as_the_config_loads(monkeypatch, tmp_path, capsys):
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")  # installed, as far as a lookup can tell
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["check", "logging.wandb=true"]) == 2
    assert "logging.wandb: wandb has no key: run `wandb login` (or set WANDB_API_KEY)" in \
        one_message(capsys.readouterr().err)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["check", "logging.wandb=true"]) == 0
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "no.netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")  # `wandb login`
    assert main(["check", "logging.wandb=true"]) == 0


# --- what the README asks for beside a choice -----------------------------------------------------------
@pytest.mark.parametrize("overrides, stale", [
    (["control.scheduler=async"], "control.scheduler=async"),
    (["control.scheduler=sorted", "control.sorted.mode=partial"], "control.sorted.mode=partial")])
def test_stale_samples_under_a_loss_that_ignores_their_age_are_warned_of(overrides, stale, capsys):
    assert main(["check", *overrides]) == 0
    assert (f"warning: {stale} trains on samples of older weights, which trainer.loss=dapo does not correct for; "
            "set trainer.loss=decoupled_ppo") in capsys.readouterr().out
    for fine in (overrides + ["trainer.loss=decoupled_ppo"], ["control.scheduler=async", "control.staleness.eta=0"],
                 ["control.scheduler=sorted"]):
        assert main(["check", *fine]) == 0
        assert "warning" not in capsys.readouterr().out


def test_several_nodes_asked_of_the_one_node_ray_a_run_starts_is_refused(tmp_path, capsys):
    assert main(["train", "cluster.nodes=2", f"output_dir={tmp_path / 'run'}"]) == 2
    assert ("cluster.nodes=2: the Ray cluster a run starts itself (cluster.address unset) is this one machine, so "
            "it would train on one node") in one_message(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
    assert main(["check", "cluster.nodes=2", "cluster.address=10.0.0.1:6379"]) == 0  # a running multi-node Ray
    assert "would fail" not in capsys.readouterr().err
