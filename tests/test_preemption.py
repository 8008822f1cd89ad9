"""Pre-emption of a real process: SIGKILL in the middle of a checkpoint write, SIGTERM in a live run."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from rlsys.checkpoint import STATE_FILE, CheckpointManager
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


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_step_saves_a_checkpoint_and_resume_goes_on(tmp_path, signum):
    """SIGTERM (a pre-emption notice) or SIGINT (Ctrl-C) to the driver once a step is logged: it finishes the
    step it is in, checkpoints it (save_every=0: no other checkpoint before the end), skips the final eval and
    export, exits 0 and prints the command that continues. Starting again without --resume is refused, losing
    nothing; --resume finishes the run.
    Steps take well under a second here, so the bounds allow for the time between reading the log and the
    signal landing, and the run is long enough that the signal always lands before its end."""
    out, total = tmp_path / "run", 8
    cmd = [sys.executable, "-m", "rlsys.cli", "train", str(DEFAULT_CONFIG), f"trainer.total_steps={total}",
           "control.save_every=0", "control.eval_every=0", f"output_dir={out}", *SMALL]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and "timing/train_s" in metrics.read_text()):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first step"
            time.sleep(0.05)
        logged = max(r["step"] for r in rows(out) if "timing/train_s" in r)
        proc.send_signal(signum)  # the driver only, as a pre-emption notice reaches it
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-3000:]
    steps = [r["step"] for r in rows(out) if "timing/train_s" in r]
    stopped = steps[-1]
    # The step running at the signal is logged + 1, or logged + 2 if that one ended between the read and the send.
    assert steps == list(range(1, stopped + 1)) and logged < stopped <= logged + 2 < total
    assert signal.Signals(signum).name in log and "Traceback" not in log
    assert f"stopped at step {stopped}; `rlsys train {' '.join(cmd[4:])} --resume` continues" in log
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stopped:06d}"]
    assert json.loads((out / "checkpoints" / f"step_{stopped:06d}" / STATE_FILE).read_text())["step"] == stopped
    assert not (out / "export").exists() and not any(r.get("final") for r in rows(out))

    logged_before = (out / "metrics.jsonl").read_text()
    again = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)  # --resume forgotten
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert f"last checkpoint is step {stopped}). Continue it with --resume" in again.stderr
    assert (out / "metrics.jsonl").read_text() == logged_before
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stopped:06d}"]

    resumed = subprocess.run(cmd + ["--resume"], env=env, timeout=300, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {stopped}" in resumed.stdout
    assert [r["step"] for r in rows(out) if "timing/train_s" in r] == list(range(1, total + 1))
    assert (out / "export" / "model.safetensors").exists() and rows(out)[-1].get("final")
