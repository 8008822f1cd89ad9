"""A finished run is never trained again by --resume (a requeue script passes it always); a larger
trainer.total_steps continues it."""
import json

import pytest

from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG

from helpers import SMALL

pytestmark = pytest.mark.slow


def snapshot(run_dir):
    """Every file of a run folder with its size and modification time."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_finished_run_resumed_says_so_and_changes_nothing(two_step_run, capsys):
    before = snapshot(two_step_run)
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={two_step_run}", *SMALL,
                 "rollout.max_new_tokens_stages=[[0, 4], [1, 48]]", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{two_step_run} is a finished run (step 2, trainer.total_steps=2): nothing to do" in out
    assert "a larger trainer.total_steps continues it" in out and "done:" not in out
    assert snapshot(two_step_run) == before


def test_a_larger_total_steps_continues_a_finished_run(tmp_path, ray_cluster, capsys):
    run = tmp_path / "run"
    common = [str(DEFAULT_CONFIG), f"output_dir={run}", "control.eval_every=0", *SMALL]
    assert main(["train", *common, "trainer.total_steps=1"]) == 0
    assert main(["train", *common, "trainer.total_steps=2", "--resume"]) == 0
    assert "done: step 2" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "timing/train_s" in r] == [1, 2]
    assert [r["step"] for r in rows if r.get("final")] == [2]  # the first end's final row was dropped
    state = json.loads((run / "checkpoints" / "step_000002" / "controller.json").read_text())
    assert state["step"] == 2
