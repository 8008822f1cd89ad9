"""`sorted` in both modes through the whole system: Ray actors, the CPU engine, rewards, DeepSpeed."""
import pytest

from rlsys.bench import summarise_run
from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG
from test_end_to_end import SMALL, rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode, loss", [("on_policy", "dapo"), ("partial", "decoupled_ppo")])
def test_sorted_trains_each_prompt_once_in_finish_order_within_its_bounds(tmp_path, ray_cluster, mode, loss):
    out = tmp_path / mode
    # 16 prompts x 4 samples per round on 16 slots: the engine is oversubscribed and each update aborts
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=4", f"output_dir={out}", "control.eval_every=0",
                 "control.scheduler=sorted", f"control.sorted.mode={mode}", f"trainer.loss={loss}",
                 "control.sorted.max_versions=2", *SMALL]) == 0
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4]
    assert all(r["samples"] == 16 for r in steps)  # B = 4 groups of 4 per update: one round
    last = steps[-1]
    assert last["sorted/round"] == 1 and last["sorted/deferred_prompts"] == 0
    assert last["sorted/aborted"] > 0  # requests were cut at updates
    # the bench times sorted over whole rounds: here its one round of four updates, the warm-up window included
    step_time = summarise_run(rows(out), target=1.0)["step_time_s"]
    assert step_time == pytest.approx(sum(r["timing/step_s"] for r in steps) / len(steps))
    if mode == "on_policy":
        assert last["staleness/max"] == 0  # never a token of older weights
    else:
        assert last["staleness/max_versions"] <= 2 and last["staleness/max"] <= 1
    # the controller checked the ledger after every update: each prompt drawn trained once or dropped
