"""The simulator replays a live emulated run on the run's own GPU budget (rlsys/sim/replay.py, rlsys/emulate.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

from rlsys.config import read_config, save_config
from rlsys.emulate import Budget
from rlsys.sim.replay import replay_config
from rlsys.sim.simulator import Simulation
from rlsys.startup import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "emulated_h100_7b.yaml"
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


# The schedules that generate while they train share the GPUs resident (an engine asleep cannot generate): a 1.5B
# model's trainer leaves its engines KV on 2 GPUs, a 7B one none
@pytest.mark.parametrize("preset", [
    ["control.scheduler=async", "trainer.loss=decoupled_ppo", "emulate.model=qwen2.5-1.5b"],
    ["control.scheduler=tail", "trainer.streamed=true", "emulate.model=qwen2.5-1.5b"],  # streams during the round
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
    # on 4 GPUs: on 2, Qwen2.5-7B's Adam states would not fit the trainer's 1 (rlsys/emulate.py check_trainer_fits)
    split = run_folder(tmp_path, ["control.scheduler=async", "trainer.loss=decoupled_ppo", "emulate.layout=separate",
                                  "emulate.gpus=4"])
    cfg, _ = replay_config(split)
    assert (cfg.cluster.gpus, cfg.cluster.trainer_gpus) == (4, 2)  # 2 engine GPUs, 2 trainer GPUs, as live
    # every other round a long one, where alone a scale-down comes
    scaled = run_folder(tmp_path, ["control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4",
                                   "control.tail.max_wait_steps=1",
                                   "emulate.model=qwen2.5-1.5b"])  # whose Adam states fit the 1 GPU lent
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


def complete_run(path: Path, overrides: list[str]) -> Path:
    """run_folder with the metrics of a run that reached its last step, as `rlsys bench --budgets` leaves it."""
    path.mkdir(parents=True)
    run_folder(path, overrides)
    step = {"timing/step_s": 2.0, "timing/rollout_s": 1.5, "timing/reward_s": 0.0, "timing/train_s": 0.4,
            "timing/weight_sync_s": 0.1, "rollout/bubble_ratio": 0.2, "samples": PROMPTS * GROUP}
    rows = [{"step": s, **step} for s in range(1, STEPS + 1)]
    rows[-1] |= {"emulate/overrun_share": 0.01, "emulate/emulating": True}
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_topped_up_budget_replay_replaces_the_presets_run_again_and_keeps_the_others(tmp_path):
    spec = importlib.util.spec_from_file_location("emulated_vs_sim", ROOT / "benchmarks" / "emulated_vs_sim.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    first, again, out = tmp_path / "first", tmp_path / "again", tmp_path / "replay.json"
    for seed in (0, 1):
        complete_run(first / f"sync-s{seed}", ["control.scheduler=sync", f"seed={seed}"])
        complete_run(first / f"tail-s{seed}", ["control.scheduler=tail", f"seed={seed}"])
    complete_run(again / "tail-s0", ["control.scheduler=tail", "seed=0"])
    (again / "sync-s0").mkdir()
    run_folder(again / "sync-s0", ["control.scheduler=sync"])  # no metrics: not complete, not replayed
    assert script.main(["--budget-runs", str(first), "--output", str(out)]) == 0
    before = json.loads(out.read_text())
    assert script.main(["--budget-runs", str(again), "--output", str(out), "--top-up"]) == 0
    after = json.loads(out.read_text())
    assert list(after["runs"]) == ["sync", "tail"] and after["runs"]["sync"] == before["runs"]["sync"]
    assert [r["folder"] for r in after["runs"]["tail"]] == [str(again)]  # every seed of tail replaced
    assert after["results"]["tail"]["seeds"] == 1 and after["results"]["sync"] == before["results"]["sync"]
    assert after["folders"] == [str(first), str(again)] and "; then " in after["command"]
    assert script.main(["--budget-runs", str(again), "--output", str(out)]) == 0  # without --top-up: only these
    assert list(json.loads(out.read_text())["runs"]) == ["tail"]
