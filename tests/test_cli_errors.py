"""A user's own mistake (config, data, model files) reads as one message and a non-zero exit, not a
traceback; `--traceback` shows it when wanted. Faults of rlsys itself keep their traceback."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsys.cli import main, user_error
from rlsys.config import DEFAULT_CONFIG
from rlsys.config import ConfigError
from rlsys.data import DataError
from rlsys.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_a_missing_config_file_is_one_message_and_exit_status_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"rlsys: config file not found: {tmp_path / 'nope.yaml'}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # the message and the hint


@pytest.mark.parametrize("argv", [["--traceback", "train"], ["train", "--traceback"]])
def test_traceback_flag_before_or_after_the_command_raises_the_error(tmp_path, argv):
    with pytest.raises(ConfigError, match="config file not found"):
        main(argv + [str(tmp_path / "nope.yaml")])


def test_a_bad_override_is_one_message(capsys):
    assert main(["train", "trainer.total_steps=-3"]) == 2
    assert "trainer.total_steps: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_a_fault_of_rlsys_itself_keeps_its_traceback(monkeypatch):
    import rlsys.cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(rlsys.cli, "cmd_plot", broken)
    with pytest.raises(KeyError):
        main(["plot", "runs/none"])


def test_a_user_error_raised_inside_an_actor_is_recognised(ray_cluster):
    @ray_cluster.remote
    def read_rows():
        raise DataError("rows.jsonl, line 3: not valid JSON")

    with pytest.raises(Exception) as raised:
        ray_cluster.get(read_rows.remote())
    assert str(user_error(raised.value)) == "rows.jsonl, line 3: not valid JSON"
    assert user_error(RuntimeError("not the user's")) is None


@pytest.mark.slow
def test_training_on_prompts_longer_than_max_prompt_tokens_prints_the_reason_alone(tmp_path, ray_address):
    """The newcomer's case: a veRL jsonl whose prompts all exceed the default data.max_prompt_tokens."""
    row = {"prompt": [{"role": "user", "content": "What is the sum of all positive integers n such that n^2 "
                                                   "+ 12n - 2007 is a perfect square? Box the answer."}],
           "reward_model": {"ground_truth": "3"}}
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(6)) + "\n")
    done = subprocess.run([sys.executable, "-m", "rlsys.cli", "train", "data.task=files", f"data.train_path={data}",
                           "data.eval_size=2", f"output_dir={tmp_path / 'run'}", f"cluster.address={ray_address}",
                           "model.warm_start.steps=0"],  # the data check comes after the model is built
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rlsys: all 4 training prompts are longer than data.max_prompt_tokens=64 tokens" in done.stderr
    assert "Traceback" not in done.stderr


def test_resume_without_a_checkpoint_is_one_message_before_anything_starts(tmp_path, capsys):
    assert main(["train", f"output_dir={tmp_path / 'run'}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: no complete checkpoint under {tmp_path / 'run' / 'checkpoints'}" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_overwrite_moves_the_earlier_run_aside_whole(tmp_path):
    from rlsys.checkpoint import claim_run_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "controller.json").write_text('{"step": 3}')
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(UserError, match=r"holds a run \(metrics.jsonl, checkpoints; its last checkpoint is step 3\)"):
        claim_run_dir(run, resume=False)
    claim_run_dir(run, resume=True)  # a run to continue: nothing moves
    assert (run / "metrics.jsonl").exists()
    claim_run_dir(run, resume=False, overwrite=True)
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert not run.exists() and (aside / "metrics.jsonl").read_text() == '{"step": 3}\n'
    assert (aside / "checkpoints" / "step_000003" / "controller.json").exists()
    claim_run_dir(tmp_path / "new", resume=False)  # an unused folder: nothing to say


@pytest.mark.parametrize("argv", [
    ["bench", "--presets", "sync", str(DEFAULT_CONFIG), "trainer.total_steps=-3"],
    ["bench", str(DEFAULT_CONFIG), "--presets", "sync", "trainer.total_steps=-3"],
    ["train", str(DEFAULT_CONFIG), "--resume", "trainer.total_steps=-3"]])
def test_config_overrides_and_options_in_any_order(argv, capsys):
    assert main(argv) == 2  # the override after the option reached the config: its error, not argparse's
    assert "trainer.total_steps: Input should be greater than or equal to 1" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("control.scheduler=sortd", "control.scheduler: unknown scheduler 'sortd'; did you mean 'sorted'?"),
    ("control.group_sizer=sagcc", "control.group_sizer: unknown group sizer 'sagcc'; did you mean 'sagc'?"),
    ("reward.fn=mathverify", "reward.fn: unknown reward function 'mathverify'; did you mean 'math_verify'?"),
    ("trainer.loss=dapoo", "trainer.loss: unknown policy loss 'dapoo'; did you mean 'dapo'?"),
    ("trainer.advantage=rlo", "trainer.advantage: unknown advantage estimator 'rlo'; did you mean 'rloo'?"),
    ("data.task=wordproblems", "data.task: unknown task family 'wordproblems'; did you mean 'word_problems'?"),
    ("rollout.engine=vlm", "rollout.engine: unknown rollout engine 'vlm'"),
    ("trainer.backend=deepspeeed", "trainer.backend: Input should be 'deepspeed' or 'torch'"),
    ("weights.transfer=cuda-ipc", "weights.transfer: Input should be 'object_store', 'broadcast' or 'cuda_ipc'")])
def test_every_name_chosen_from_a_list_is_checked_when_the_config_loads(override, message, tmp_path, capsys):
    """Each would otherwise fail only once the part using it starts (a KeyError traceback after 17-132 s)."""
    assert main(["train", override, f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.slow
def test_a_gpu_config_trained_on_a_host_without_gpus_is_one_message_not_a_two_minute_wait(tmp_path):
    """The Ray rlsys starts here has what this machine has: no GPUs will join it (a cluster it joins may grow)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the config would train")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlsys.cli", "train", "configs/gpu/smoke.yaml",
                           f"output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("rlsys: the plan uses 1 GPUs (cluster.nodes=1 x cluster.gpus_per_node=1) and the Ray started on this "
            "machine has 0: run it where the GPUs are") in done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 100  # a placement group waits 120 s
