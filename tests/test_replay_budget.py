"""The simulator replays a live emulated run on the run's own GPU budget (rlsys/sim/replay.py, rlsys/emulate.py)."""
import json
from pathlib import Path

import pytest

from rlsys.config import read_config, save_config
from rlsys.emulate import Budget
from rlsys.sim.replay import replay_config
from rlsys.sim.simulator import Simulation
from rlsys.startup import load_config

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "emulated_h100_7b.yaml"
STEPS, PROMPTS, GROUP = 3, 16, 8


def run_folder(path: Path, overrides: list[str]) -> Path:
    """A live run's config and a timeline of STEPS steps whose prompts' samples vary in length, one in eight near
    the cap: a tail that the tail scheduler leaves for its long round."""
    save_config(load_config(CONFIG, [f"trainer.total_steps={STEPS}", *overrides]), path / "config.yaml")
    timeline = [{"step": min(STEPS, 1 + p // PROMPTS), "request_id": f"train-{p}#{p * GROUP + i}",
                 "tokens": 120 if (p + i) % 8 == 0 else 5 + (p * 7 + i * 3) % 50, "prompt_tokens": 9,
                 "finish_reason": "stop"} for p in range(2 * STEPS * PROMPTS) for i in range(GROUP)]
    (path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    return path


def replayed(path: Path) -> tuple[Simulation, dict]:
    """The replay of the run in `path`, run with every engine's decoding recorded."""
    cfg, workload = replay_config(path)
    sim = Simulation(cfg, cfg.runs()[0], workload)
    for engine in sim.engines:
        engine.decode_spans = []
    return sim, sim.run()


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


@pytest.mark.parametrize("preset", [
    ["control.scheduler=async", "trainer.loss=decoupled_ppo"],  # generates while it trains
    ["control.scheduler=tail", "trainer.streamed=true"],  # streams gradients during the round
    ["control.scheduler=sync"]])
def test_a_colocated_replay_never_decodes_on_a_gpu_the_trainer_holds(tmp_path, preset):
    run = run_folder(tmp_path, preset)
    live = read_config(run / "config.yaml")[0]
    sim, result = replayed(run)
    budget = Budget.of_run(live)
    assert budget.layout == "colocated" and sim.cluster.gpus == budget.gpus == 2 and sim.trainer_gpus == 2
    assert len(sim.engines) == len(budget.engines) == live.rollout.num_workers
    assert result["steps"] == STEPS and len(sim.trainer_spans) >= STEPS
    if live.trainer.streamed:  # streamed batches took the GPUs during the rounds, beside each step's Train
        assert len(sim.trainer_spans) > STEPS
    decoded = [span for engine in sim.engines for span in engine.decode_spans]
    assert decoded and sum(end - begin for begin, end in sim.trainer_spans) > 0
    # float64 event times: a decode span may touch a trainer span's edge, never run into it
    assert overlap(decoded, sim.trainer_spans) == pytest.approx(0.0, abs=1e-9)


def test_a_split_replay_keeps_the_runs_split_and_a_scale_down_its_lending(tmp_path):
    split = run_folder(tmp_path, ["control.scheduler=async", "trainer.loss=decoupled_ppo", "emulate.layout=separate",
                                  "rollout.num_workers=1"])
    cfg, _ = replay_config(split)
    assert (cfg.cluster.gpus, cfg.cluster.trainer_gpus) == (2, 1)  # 1 engine GPU, 1 trainer GPU, as live
    scaled = run_folder(tmp_path, ["control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4"])
    sim, result = replayed(scaled)
    assert sim.trainer.scale_down_at == 0.4 and not sim.contending  # the streamed batches on the lent GPUs alone
    assert result["requests"]["migrated"] > 0 and sim.cluster.gpus == 2


def test_a_colocated_budget_with_gpus_no_engine_stands_on_is_refused(tmp_path):
    run = run_folder(tmp_path, ["emulate.gpus=4"])
    with pytest.raises(ValueError, match="leaves GPUs without an engine"):
        replay_config(run)


def test_a_replay_counts_every_slot_of_every_engine_in_its_bubble_as_the_live_run_does(tmp_path):
    """The live bubble ratio's capacity is rollout.slots per engine (rlsys/rollout/manager.py); at 4 engines of 80
    slots a step's 128 requests fill 32 a engine, which the simulator alone would count as full."""
    run = run_folder(tmp_path, ["emulate.gpus=4", "rollout.num_workers=4", "rollout.slots=80"])
    live = read_config(run / "config.yaml")[0]
    sim, result = replayed(run)
    assert [e.slots for e in sim.engines] == [live.rollout.slots] * live.rollout.num_workers
    busy = sum(e.busy_slot_s for e in sim.engines)
    assert result["bubble_ratio"] == pytest.approx(1 - busy / sum(80 * e.alloc_s for e in sim.engines))
    cfg, workload = replay_config(run)
    cfg.engine.bubble_slots = None  # the simulator's own capacity: a nominal step's requests per engine
    assert [e.slots for e in Simulation(cfg, cfg.runs()[0], workload).engines] == [32] * 4
