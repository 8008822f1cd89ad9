"""Pre-emption of a real process: SIGKILL in the middle of a checkpoint write, SIGTERM and SIGINT in a live run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from rlsys.checkpoint import STATE_FILE, CheckpointManager
from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG
from test_end_to_end import SMALL, rows

# Writes a complete step-1 checkpoint, then step 2 as a writer that puts its state file first: the
# weights are half written when it reports "writing" and waits to be killed.
WRITER = """
import sys, time
from pathlib import Path
import numpy as np
from safetensors.numpy import save
from rlsys.checkpoint import STATE_FILE, CheckpointManager, write_json_atomic

root, ready = Path(sys.argv[1]), Path(sys.argv[2])
weights = save({"w": np.arange(4096, dtype=np.float32)})

def write(step, block):
    def fill(folder):
        write_json_atomic(folder / STATE_FILE, {"step": step})
        with open(folder / "model.safetensors", "wb") as f:
            f.write(weights[: len(weights) // 2] if block else weights)
            f.flush()
            if block:
                ready.write_text(str(folder))
                time.sleep(600)
    return fill

manager = CheckpointManager(root)
manager.save(1, write(1, False))
manager.save(2, write(2, True))
"""


def test_sigkill_mid_checkpoint_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    root, ready = tmp_path / "checkpoints", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(ready)])
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None and time.time() < deadline, "the writer ended before its second checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL

    manager = CheckpointManager(root)
    latest = manager.latest()
    assert latest == root / "step_000001" and manager.completed() == [latest]
    assert json.loads((latest / STATE_FILE).read_text()) == {"step": 1}
    np.testing.assert_array_equal(load_file(str(latest / "model.safetensors"))["w"], np.arange(4096, dtype=np.float32))
    half = root / "step_000002.tmp"  # where the killed write went: it has a state file, so it looks complete
    assert ready.read_text() == str(half) and (half / STATE_FILE).exists()

    def write(folder):
        (folder / STATE_FILE).write_text(json.dumps({"step": 3}))
        (folder / "model.safetensors").write_bytes(save({"w": np.zeros(1, dtype=np.float32)}))
    manager.save(3, write)  # the next save clears what the killed one left
    assert not half.exists() and sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000003"]
    assert manager.latest() == root / "step_000003"


def trained_steps(out):
    return [r["step"] for r in rows(out) if "timing/train_s" in r]


def stop_once_a_step_is_logged(cmd, env, out, signum, after=0):
    """Starts `cmd`, sends `signum` to the driver once it has logged a step past `after`, waits for it to exit:
    (its output, the last step logged when the signal was sent)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() or max(trained_steps(out), default=0) <= after:
            assert proc.poll() is None and time.time() < deadline, f"the run ended before a step past {after}"
            time.sleep(0.05)
        logged = max(trained_steps(out))
        proc.send_signal(signum)  # the driver only, as a pre-emption notice reaches it
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-3000:]
    return log, logged


def assert_stopped(out, log, signum, logged, total, go_on, kept) -> int:
    """The run stopped by `signum` finished the step it was in, checkpointed it beside the earlier checkpoints
    `kept`, wrote no export or final row and said how to go on: the step it stopped at."""
    steps = trained_steps(out)
    stopped = steps[-1]
    # The step running at the signal is logged + 1, or logged + 2 if that one ended between the read and the send.
    assert steps == list(range(1, stopped + 1)) and logged < stopped <= logged + 2 < total
    assert signal.Signals(signum).name in log and "Traceback" not in log
    assert f"stopped at step {stopped}; `{go_on}` continues" in log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{s:06d}" for s in [*kept, stopped]]
    assert json.loads((out / "checkpoints" / f"step_{stopped:06d}" / STATE_FILE).read_text())["step"] == stopped
    assert not (out / "export").exists() and not any(r.get("final") for r in rows(out))
    return stopped


@pytest.mark.slow
def test_a_stop_signal_ends_the_step_saves_a_checkpoint_and_resume_goes_on(tmp_path, ray_address, capsys):
    """SIGTERM (a pre-emption notice) once a step is logged, then SIGINT (Ctrl-C) once the resumed run logs one: the
    driver finishes the step it is in, checkpoints it (save_every=0: no other checkpoint before the end), skips the
    final eval and export, exits 0 and prints the command that continues. Starting again without --resume is
    refused, losing nothing; --resume goes on from the checkpoint, and the last one finishes the run.
    Steps take well under a second here, so the bounds allow for the time between reading the log and the
    signal landing, and the run is long enough that both signals always land before its end."""
    out, total = tmp_path / "run", 10
    args = ["train", str(DEFAULT_CONFIG), f"trainer.total_steps={total}", "control.save_every=0",
            "control.eval_every=0", f"output_dir={out}", f"cluster.address={ray_address}", *SMALL]
    rlsys = Path(sys.executable).with_name("rlsys")  # as `make setup` leaves it: .venv/bin/rlsys, not on PATH
    cmd, go_on = [str(rlsys), *args], f"{rlsys} {' '.join(args)} --resume"  # the command that works, printed
    path = [d for d in os.environ["PATH"].split(os.pathsep) if Path(d).resolve() != rlsys.parent.resolve()]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=os.pathsep.join(path))
    log, logged = stop_once_a_step_is_logged(cmd, env, out, signal.SIGTERM)
    first = assert_stopped(out, log, signal.SIGTERM, logged, total, go_on, kept=[])

    logged_before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(args) == 2  # --resume forgotten: refused before anything starts
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"last checkpoint is step {first}). Continue it with --resume" in err
    assert (out / "metrics.jsonl").read_text() == logged_before
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{first:06d}"]

    log, logged = stop_once_a_step_is_logged(cmd + ["--resume"], env, out, signal.SIGINT, after=first)
    assert f"at step {first}" in log
    second = assert_stopped(out, log, signal.SIGINT, logged, total, go_on, kept=[first])

    capsys.readouterr()
    assert main(args + ["--resume"]) == 0  # in this process: no signal to send, so no child to start
    assert f"at step {second}" in capsys.readouterr().out
    assert trained_steps(out) == list(range(1, total + 1))
    assert (out / "export" / "model.safetensors").exists() and rows(out)[-1].get("final")
