"""RollPacker's stream trainer live (trainer.scale_down_at): the config that may ask for it, the trainer on the
lent GPUs alone under the emulated clock, and a run that scales down in its long round only. The move itself (requests cut
with their tokens, resumed elsewhere to the same samples) is tests/test_rollout.py's."""
import json
import threading
import time
from pathlib import Path

import pytest

from rlsys import costs
from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG, ConfigError
from rlsys.emulate import Emulation
from rlsys.placement import lent_engines
from rlsys.startup import load_config

from helpers import SMALL

EMULATED = Path(__file__).resolve().parent.parent / "configs" / "emulated_h100_7b.yaml"
SCALE_DOWN = ["control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.scale_down_at=0.4"], r"trainer.scale_down_at=0.4 lends half the engines' GPUs to the streamed "
                                    r"trainer: it needs trainer.streamed=true and control.scheduler=tail \(got "
                                    r"trainer.streamed=false, control.scheduler=sync\)"),
    (["control.scheduler=tail", "trainer.scale_down_at=0.4"], r"needs trainer.streamed=true"),
    ([*SCALE_DOWN, "rollout.num_workers=1"], r"needs rollout.num_workers >= 2 \(got 1\)"),
    ([*SCALE_DOWN, "emulate.layout=separate", "emulate.gpus=3"],
     r"needs cluster.layout=colocated and, emulated, emulate.gpus with emulate.layout=colocated"),
    ([*SCALE_DOWN, "trainer.scale_down_at=0"], r"trainer.scale_down_at: Input should be greater than 0"),
    ([*SCALE_DOWN, "trainer.world_size=2"], r"the modelled GPUs of the engines it scales down, 1 \(rollout.num_workers"
                                            r"=2, emulate.tp=1\): trainer.world_size=2 must divide them"),
])
def test_a_scale_down_the_run_cannot_do_is_refused_naming_the_fields(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EMULATED, overrides)


def test_the_scale_down_preset_loads_on_the_emulated_budget():
    from rlsys.bench import PRESETS

    # Qwen2.5-7B's Adam states do not fit the 1 GPU a 2-GPU budget's scale-down lends (tests/test_emulate.py)
    with pytest.raises(ConfigError, match=r"needs 125 GB on each of the 1 modelled GPUs of the engines"):
        load_config(EMULATED, PRESETS["tail-scaledown"])
    cfg = load_config(EMULATED, PRESETS["tail-scaledown"] + ["emulate.gpus=4", "rollout.num_workers=4"])
    assert cfg.trainer.scale_down_at == 0.4 and lent_engines(cfg.rollout.num_workers) == [2, 3]
    assert load_config(None, SCALE_DOWN + ["rollout.num_workers=2"]).trainer.scale_down_at == 0.4  # and on CPU


def overlap(a: list, b: list) -> float:
    return sum(max(0.0, min(e1, e2) - max(b1, b2)) for b1, e1 in a for b2, e2 in b)


def test_after_a_scale_down_the_trainer_stands_on_the_lent_gpu_alone(tmp_path):
    """Engine 0 kept, engine 1 scaled down: the trainer's micro-batches reserve GPU 1 alone, at one GPU's pace,
    so engine 0 decodes beside them and engine 1 never steps while one runs; lent back, the trainer has both."""
    # Qwen2.5-1.5B, whose Adam states fit the lent GPU, resident beside the engines (no switch to wait for)
    cfg = load_config(EMULATED, [*SCALE_DOWN, "emulate.time_scale=1.0", "emulate.tokens_per_token=1",
                                 "emulate.model=qwen2.5-1.5b", "emulate.colocation=resident", f"output_dir={tmp_path}"])
    emulation = Emulation.of(cfg)
    kept, freed, trainer = emulation.engine_pacer(0), emulation.engine_pacer(1), emulation.trainer_pacer(1)
    own_s = trainer.micro_batch_s(3000, costs.TRAIN_FLOPS)
    [lent] = emulation.budget.lent(lent_engines(2), 1)
    assert lent == (1,)
    trainer.lend(lent)
    assert trainer.on_gpus == (1,) and trainer.micro_batch_s(3000, costs.TRAIN_FLOPS) == pytest.approx(2 * own_s)
    spans = {"kept": [], "freed": [], "trainer": []}

    def steps(name, pacer):
        for _ in range(30):
            spans[name].append(pacer.step(time.perf_counter(), 0, 64, 64 * 40))  # ~2 ms modelled

    def micro_batches():
        for _ in range(6):
            spans["trainer"].append(trainer.micro_batch(time.perf_counter(), 3000, costs.TRAIN_FLOPS))  # ~80 ms
            time.sleep(0.005)

    threads = [threading.Thread(target=steps, args=("kept", kept)),
               threading.Thread(target=steps, args=("freed", freed)), threading.Thread(target=micro_batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlap(spans["freed"], spans["trainer"]) == 0.0  # one after the other on the lent GPU
    assert overlap(spans["kept"], spans["trainer"]) > 0.05  # the kept engine decodes undisturbed beside
    assert trainer.counts()["lent_held"] == 6
    trainer.lend(None)
    assert trainer.on_gpus == (0, 1) and trainer.micro_batch_s(3000, costs.TRAIN_FLOPS) == own_s


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.mark.slow
def test_a_run_scales_down_in_its_long_round_only_and_no_request_starts_on_a_freed_engine_before_the_train(
        tmp_path, ray_cluster):
    """RollPacker scales down in long rounds only. The first step is a short round (5 prompts drawn for 4): it
    trains every group, lends no GPU and streams nothing; its prompt left unfinished has waited
    control.tail.max_wait_steps=1 at the second step, a long round, which scales down at its first of 4 groups; the
    freed engine starts no request from then to the step's Train, and the streamed micro-batches stand on the lent
    GPU. The engines are paced in real time (emulate.time_scale=1) on 2 slots each, so that the freed one still
    holds requests when the first group is scored: unpaced, the tiny model can finish every request before its
    rewards come back."""
    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}", "control.eval_every=0",
                 *SCALE_DOWN, "trainer.scale_down_at=0.25", "trainer.mini_batches=2", "rollout.num_workers=2", *SMALL,
                 "control.tail.max_wait_steps=1", "rollout.slots=2", "emulate.gpu=h100",
                 "emulate.model=qwen2.5-1.5b", "emulate.gpus=2", "emulate.time_scale=1.0"]) == 0
    short, long = steps = [r for r in rows(out / "metrics.jsonl") if "timing/train_s" in r]
    assert [r["policy_version"] for r in steps] == [1, 2] and [r["tail/round"] for r in steps] == [0, 1]
    assert all(r["train/sequences"] == 16 for r in steps) and long["tail/max_wait"] == 1
    assert not {"rollout/scaled_down_at_s", "rollout/moved"} & set(short) and short["emulate/lent_micro_batches"] == 0
    # At the first of 4 groups, of 16 requests on 2 engines of 2 slots, some wait or run on the freed one
    assert "rollout/scaled_down_at_s" in long and long["rollout/moved"] > 0 and long["emulate/lent_micro_batches"] > 0
    on_freed = [c for c in rows(out / "timeline.jsonl") if c["step"] == long["step"] and c["worker"] == 1]
    assert on_freed and all(c["start"] < long["rollout/scaled_down_at_s"] for c in on_freed)
