"""Simulator mechanisms for the calibration: reward overlap, streamed training, H20, the elastic planner under
tail batching and async with its own trainer GPUs. Each: accounting holds, time never goes back, same seed same run."""
import json

import pytest

from rlsys.config import ConfigError
from rlsys.sim.cluster import GPUS, makespan
from rlsys.sim.config import load_sim_config
from rlsys.sim.run import simulate
from rlsys.sim.simulator import Simulation

SLOW_REWARD = {"kinds": {"code": {"share": 1, "median_s": 2.0, "sigma": 0.5}}, "workers": 8}
MECHANISMS = {
    "batch-reward": {"name": "sync", "reward": {"overlap": False}},
    "overlap-reward": {"name": "tail", "reward": {"overlap": True}},
    "stream": {"name": "tail", "trainer": {"streamed": True}},
    "planner": {"name": "tail", "control": {"elastic_tp": {"enabled": True, "max_tp": 2}}},
    "async-own-gpus": {"name": "async", "cluster": {"trainer_gpus": 2}, "trainer": {"streamed": True}},
    "sorted-stream": {"name": "sorted", "trainer": {"streamed": True}, "reward": {"overlap": False}},
}


def small(runs, **extra):
    cfg = {"name": "mech", "steps": 4, "model": "qwen2.5-1.5b", "cluster": {"gpus": 4, "tp": 1},
           "workload": {"max_tokens": 4096, "median_tokens": 600}, "reward": SLOW_REWARD,
           "control": {"prompts_per_step": 16, "group_size": 4},
           "schedulers": [{"label": k, **v} for k, v in runs.items()]}
    cfg.update(extra)
    return cfg


def one(run: dict, **extra) -> dict:
    return simulate(small({"x": run}, **extra), quiet=True)["results"]["x"]


@pytest.mark.parametrize("label", sorted(MECHANISMS))
def test_mechanism_keeps_time_and_accounting(label):
    cfg = load_sim_config(small({label: MECHANISMS[label]}))
    sim = Simulation(cfg, cfg.runs()[0])
    trace = []
    r = sim.run(trace)  # Simulation.check raises on broken request or prompt accounting
    times = [t for t, _ in trace]
    assert times == sorted(times) and r["steps"] == 4
    ends = r["step_ends_s"]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(r["sim_time_s"])
    req = r["requests"]
    assert req["submitted"] >= req["finished"] + req["aborted"] - req["late_aborts"] >= 0


@pytest.mark.parametrize("label", sorted(MECHANISMS))
def test_mechanism_is_deterministic_by_seed(label):
    def figures(seed):
        r = simulate(small({label: MECHANISMS[label]}, seed=seed), quiet=True)["results"][label]
        return json.dumps({k: v for k, v in r.items() if k != "wall"})
    assert figures(0) == figures(0) and figures(0) != figures(1)


def test_batch_reward_waits_after_the_rollout_and_overlap_hides_it():
    batch, overlap = one({"name": "sync", "reward": {"overlap": False}}), one({"name": "sync"})
    assert batch["reward_wait_s"] > 2.0 and overlap["reward_wait_s"] == 0.0
    # 64 samples of ~2 s on 8 workers: at least 16 s of scoring per step, which overlap mostly hides
    assert batch["reward_wait_s"] >= 64 * 2.0 / 8 * 0.8
    assert batch["step_time_s"] > overlap["step_time_s"] + 5


def test_makespan_of_a_bounded_pool():
    assert makespan([4, 3, 2, 1], 2) == 5 and makespan([1] * 6, 3) == 2 and makespan([5, 1], None) == 5 and makespan([], 4) == 0


def test_streamed_training_fills_idle_gpus_and_never_exceeds_the_work():
    plain, streamed = one({"name": "tail"}), one({"name": "tail", "trainer": {"streamed": True}})
    assert streamed["train_time_s"] < plain["train_time_s"]
    assert streamed["train_time_s"] >= load_sim_config(small({"x": {"name": "tail"}})).trainer.overhead_s  # at most all the work
    # sync streams nothing (no Accumulate): the flag changes nothing there
    assert one({"name": "sync", "trainer": {"streamed": True}})["step_time_s"] == one({"name": "sync"})["step_time_s"]


def test_h20_trains_slower_than_h800_and_decodes_no_slower():
    h800, h20 = one({"name": "sync"}), one({"name": "sync"}, cluster={"gpus": 4, "tp": 1, "gpu": "h20"})
    assert GPUS["h20"].peak_flops < GPUS["h800"].peak_flops / 5
    overhead = load_sim_config(small({"x": {"name": "sync"}})).trainer.overhead_s
    assert h20["train_time_s"] - overhead > 3 * (h800["train_time_s"] - overhead)
    assert h20["rollout_time_s"] <= h800["rollout_time_s"] * 1.01


def test_a_run_may_not_redefine_reward_kinds():
    with pytest.raises(ConfigError, match="reward.kinds"):
        load_sim_config(small({"x": {"name": "sync", "reward": {"kinds": {}}}}))


def test_run_overrides_name_their_field():
    with pytest.raises(ConfigError, match=r"schedulers\[0\].trainer"):
        load_sim_config(small({"x": {"name": "sync", "trainer": {"streemed": True}}}))
