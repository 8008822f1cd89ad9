"""Simulator mechanisms for the calibration: reward overlap, streamed training, H20, the elastic planner under
tail batching and async with its own trainer GPUs. Each: accounting holds, time never goes back, same seed same run."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlsys.config import ConfigError
from rlsys.costs import GPUS, switch_seconds
from rlsys.sim.config import load_sim_config
from rlsys.sim.engine import SimRequest, replica_idle_by_interval, replica_idle_gpu_s
from rlsys.sim.run import simulate
from rlsys.runs import Runs, run_lengths
from rlsys.sim.simulator import Simulation, makespan

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"
SLOW_REWARD = {"kinds": {"code": {"share": 1, "median_s": 2.0, "sigma": 0.5}}, "workers": 8}
MECHANISMS = {
    "batch-reward": {"name": "sync", "reward": {"overlap": False}},
    "overlap-reward": {"name": "tail", "reward": {"overlap": True}},
    "stream": {"name": "tail", "trainer": {"streamed": True}},
    "planner": {"name": "tail", "control": {"elastic_tp": {"enabled": True, "max_tp": 2}}},
    "async-own-gpus": {"name": "async", "cluster": {"trainer_gpus": 2}},
    "sorted-batch-reward": {"name": "sorted", "reward": {"overlap": False}},
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


def test_kinds_with_their_own_pools_are_scored_in_parallel():
    """Two equally slow kinds: each on its own 4 workers (ROLL's reward cluster per kind) takes about half the
    batch scoring time of both sharing 4; a kind without its own pool uses the shared one."""
    def wait(reward):
        return one({"name": "sync", "reward": {"overlap": False}}, reward=reward)["reward_wait_s"]
    slow = {"share": 1, "median_s": 2.0, "sigma": 0.5}
    shared = wait({"kinds": {"a": slow, "b": slow}, "workers": 4})
    own = wait({"kinds": {"a": {**slow, "workers": 4}, "b": {**slow, "workers": 4}}})
    half_own = wait({"kinds": {"a": {**slow, "workers": 4}, "b": slow}, "workers": 4})
    assert own < 0.75 * shared and own == pytest.approx(half_own)


def test_makespan_of_a_bounded_pool():
    assert makespan([4, 3, 2, 1], 2) == 5 and makespan([1] * 6, 3) == 2 and makespan([5, 1], None) == 5 and makespan([], 4) == 0


def test_streamed_training_fills_idle_gpus_and_never_exceeds_the_work():
    plain, streamed = one({"name": "tail"}), one({"name": "tail", "trainer": {"streamed": True}})
    assert streamed["train_time_s"] < plain["train_time_s"]
    assert streamed["train_time_s"] >= load_sim_config(small({"x": {"name": "tail"}})).trainer.overhead_s  # at most all the work
    # only tail announces its groups (Accumulate): elsewhere the flag would change nothing, so it is refused
    for name in ("sync", "sorted", "async"):
        with pytest.raises(ConfigError, match=f"trainer.streamed needs the tail scheduler.*under {name}"):
            load_sim_config(small({"x": {"name": name, "trainer": {"streamed": True}}}))


def test_trainer_mfu_falls_beyond_the_gpus_it_was_fitted_on():
    plain = one({"name": "sync"})  # 4 colocated GPUs
    fitted_on_2 = one({"name": "sync"}, trainer={"mfu_gpus": 2, "comm_per_gpu": 0.5})  # compute x (1 + 0.5 GPUs)
    fitted_on_4 = one({"name": "sync"}, trainer={"mfu_gpus": 4, "comm_per_gpu": 0.5})
    overhead = load_sim_config(small({"x": {"name": "sync"}})).trainer.overhead_s
    assert fitted_on_4["train_time_s"] == plain["train_time_s"]
    assert fitted_on_2["train_time_s"] - overhead == pytest.approx(1.5 * (plain["train_time_s"] - overhead))  # 3 / 2


def test_trainer_mfu_law_fits_megatron_and_loses_more_per_doubling_at_scale():
    """The 14B/32B configs' comm_per_gpu reproduces the published Megatron MFU (0.40 / 0.37 / 0.31 on 8 / 16 / 32
    GPUs) from its 8-GPU point, and a doubling keeps less the more GPUs it starts from (0.925 then 0.84 there)."""
    trainer = load_sim_config(CONFIGS / "qwen14b_16k.yaml").trainer.model_copy(update={"mfu": 0.40, "mfu_gpus": 8})
    assert [trainer.mfu_on(g) for g in (8, 16, 32)] == pytest.approx([0.40, 0.37, 0.31], abs=0.006)
    keeps = [trainer.mfu_on(2 * g) / trainer.mfu_on(g) for g in (8, 32, 128)]
    assert keeps == sorted(keeps, reverse=True) and keeps[-1] < 0.7


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


def test_idle_gpus_are_lent_only_in_whole_trainer_replicas():
    a = SimpleNamespace(gpus=1, idle_spans=[(0.0, 10.0)])
    b = SimpleNamespace(gpus=1, idle_spans=[(5.0, 10.0), (12.0, 20.0)])
    assert replica_idle_gpu_s([a, b], 0.0, 20.0, 1) == 10 + 5 + 8
    assert replica_idle_gpu_s([a, b], 0.0, 20.0, 2) == 2 * 5  # both idle only in [5, 10)
    assert replica_idle_gpu_s([a, b], 6.0, 8.0, 2) == 2 * 2  # clipped to the window
    assert replica_idle_gpu_s([a, b], 0.0, 20.0, 4) == 0
    assert replica_idle_by_interval([a, b], [0.0, 6.0, 8.0, 20.0], 2) == [2 * 1, 2 * 2, 2 * 2]


def test_streamed_groups_are_credited_only_their_gradients_on_gpus_idle_after_they_came():
    # resident: the GPUs lent switch for nothing (the next test has the switches)
    cfg = load_sim_config(small({"s": {"name": "tail", "trainer": {"streamed": True, "flops_per_param_token": 10},
                                       "cluster": {"colocation": "resident"}}}))
    sim = Simulation(cfg, cfg.runs()[0])
    for engine in sim.engines:  # 4 GPUs idle over [0, 100]
        engine.idle_spans = [(0.0, 100.0)]
    sim.now, per_token = 100.0, sim._gpu_s(1)
    sim.stream.add(round(100 / per_token), 50.0, 0.0)  # 100 GPU-s of training, 60 of them forward and backward
    assert sim._streamed_gpu_s() == pytest.approx(60, rel=1e-3)
    sim.stream.add(round(1000 / per_token), 50.0, 0.0)  # more than the 4 x 50 GPU-s idle after it came
    assert sim._streamed_gpu_s() == pytest.approx(200)
    sim.stream.add(round(100 / per_token), 50.0, 0.0)  # 60 GPU-s done before the next group comes
    sim.stream.add(round(1000 / per_token), 90.0, 0.0)  # it finds only 4 x 10 GPU-s left, not the earlier idle time
    assert sim._streamed_gpu_s() == pytest.approx(60 + 40, rel=1e-3)


def test_a_scaled_down_trainer_streams_only_on_the_engines_it_freed():
    trainer = {"streamed": True, "flops_per_param_token": 6, "scale_down_at": 0.4}
    for colocation in ("resident", "sleep"):
        cfg = load_sim_config(small({"s": {"name": "tail", "trainer": trainer, "cluster": {"colocation": colocation}}}))
        sim = Simulation(cfg, cfg.runs()[0])
        for engine in sim.engines:  # 4 GPUs idle over [0, 100], one of them scaled down
            engine.idle_spans = [(0.0, 100.0)]
        sim.lent, sim.now, per_token = {3}, 100.0, sim._gpu_s(1)
        sim.stream.add(round(1000 / per_token), 0.0, 0.0)
        # 1 GPU x 100 s, not 4; asleep, less the lent GPU's switch from its engine to the trainer
        switch = switch_seconds(GPUS["h800"], 1.54e9 * 2, 1.54e9 * 16 / 4) if colocation == "sleep" else 0.0
        assert sim._streamed_gpu_s() == pytest.approx(100 - switch)
    assert switch > 0.1


def test_a_colocated_step_pays_the_switch_to_the_trainer_and_back():
    """Asleep, each Train switches every GPU from the engines to the trainer and back: the engines' bf16 weights and
    the trainer's Adam states (ZeRO-3 over the 4 GPUs) each copied out and in over the host link."""
    cfg = load_sim_config(small({"s": {"name": "sync"}}))
    sim = Simulation(cfg, cfg.runs()[0])
    result = sim.run()
    switch = (1.54e9 * 2 + 1.54e9 * 16 / 4) / (0.8 * 64e9)  # weights, states; bytes over PCIe Gen5's share
    assert result["switch_s"] == pytest.approx(switch) and switch > 0.1
    assert result["switches_per_step"] == 2
    for (begin, end), train, reward in zip(sim.trainer_spans, sim.train_s, sim.reward_s):
        assert end - begin == pytest.approx(reward + train + sim.sync_s + 2 * switch)
    # a streamed batch contending for every GPU pays both switches; one queued behind it, neither again
    cfg = load_sim_config(small({"s": {"name": "tail", "trainer": {"streamed": True, "contend": True}}}))
    sim = Simulation(cfg, cfg.runs()[0])
    touched = {}
    sim._contend(1000, touched)
    sim._contend(1000, touched)
    (b1, e1), (b2, e2) = sim.stream_spans
    assert b1 == pytest.approx(switch) and b2 == e1 and sim.switches == 3
    assert all(e.paused_until == pytest.approx(e2 + switch) for e in sim.engines)


def test_a_resident_trainer_leaves_the_engines_less_kv_and_a_trainer_that_cannot_fit_is_refused():
    sleep = load_sim_config(small({"s": {"name": "sync"}}, model="qwen2.5-7b", cluster={"gpus": 8, "tp": 1}))
    resident = load_sim_config(small({"s": {"name": "sync"}}, model="qwen2.5-7b",
                                     cluster={"gpus": 8, "tp": 1, "colocation": "resident"}))
    kv_token = 2 * 28 * 4 * 128 * 2
    trainer = 7.61e9 * 16 / 8 + 16384 * 28 * 3584 * 2  # ZeRO-3 states over 8 GPUs, checkpointed activations
    assert sleep.engine_cost(sleep.cluster).kv_capacity - resident.engine_cost(resident.cluster).kv_capacity \
        == pytest.approx(trainer / kv_token)
    assert Simulation(resident, resident.runs()[0]).run()["switch_s"] == 0.0  # and no switch to pay
    with pytest.raises(ConfigError, match=r"the trainer needs 125 GB on each of its 1 GPUs \(trainer.zero_stage=3, "
                                          r"cluster.gpus=2, cluster.trainer_gpus=1"):
        load_sim_config(small({"s": {"name": "async"}}, model="qwen2.5-7b", cluster={"gpus": 2, "trainer_gpus": 1}))


def test_a_replica_larger_than_the_cluster_streams_nothing():
    plain = one({"name": "tail"})
    lent = one({"name": "tail", "trainer": {"streamed": True, "replica_gpus": 2}})
    whole = one({"name": "tail", "trainer": {"streamed": True, "replica_gpus": 8}})  # 4 GPUs in all
    assert whole["train_time_s"] == plain["train_time_s"] > lent["train_time_s"]


def test_an_evicted_request_resumes_elsewhere_with_its_tokens_and_is_prefilled_again():
    cfg = load_sim_config(small({"x": {"name": "tail"}}))
    sim = Simulation(cfg, cfg.runs()[0])
    donor, receiver = sim.engines[0], sim.engines[1]
    draw = SimpleNamespace(length=1000, truncated=False, reward=1.0, reward_latency=0.0)
    running, waiting = (SimRequest(rid, "p", 100, draw, 0.0) for rid in ("a", "b"))
    donor.max_seqs = 1  # "b" waits in the queue
    for req in (running, waiting):
        donor.enqueue(req)
    donor.settle(0.0)
    donor.advance_to(donor.next_event()[0] / 2)  # part-way through "a"
    moved = donor.evict_all()
    assert moved == [running, waiting] and 0 < running.done < 1000 and waiting.done == 0
    assert donor.load == 0 and donor.live_kv() == 0 and donor.next_event() is None
    receiver.advance_to(donor.clock)
    for req in moved:
        receiver.enqueue(req)
    receiver.settle(donor.clock)
    assert receiver.prefill_until - donor.clock == pytest.approx(
        (100 + running.done + 100) * receiver.cost.prefill_s_per_token)  # its prompt and tokens again, and b's
    t, _ = receiver.next_event()
    receiver.advance_to(t)
    assert receiver.settle(t) == [running] and running.done == 1000  # finishes at its own length


def test_scaling_down_lends_half_the_engines_to_the_streamed_trainer():
    # every other round a long one: the scale-down comes in those alone (RollPacker's)
    streamed = {"name": "tail", "trainer": {"streamed": True}, "control": {"tail": {"max_wait_steps": 1}}}
    fast = {"kinds": {"rule": {"share": 1, "median_s": 0.005}}, "workers": 8}  # groups complete while others run
    plain = one({**streamed, "trainer": {"streamed": False}}, reward=fast)
    scaled = one({**streamed, "trainer": {"streamed": True, "scale_down_at": 0.4}}, reward=fast)
    assert scaled["requests"]["migrated"] > 0 and plain["requests"]["migrated"] == 0  # Simulation.check held
    again = one({**streamed, "trainer": {"streamed": True, "scale_down_at": 0.4}}, reward=fast)
    assert {k: v for k, v in again.items() if k != "wall"} == {k: v for k, v in scaled.items() if k != "wall"}
    # the long rounds' gradients streamed on the lent GPUs (a short round lends none, and trains after it)
    assert scaled["long_round_steps"] == [1, 3] and scaled["train_time_s"] < plain["train_time_s"]
    for run in ({"name": "tail", "trainer": {"scale_down_at": 0.4}},
                {**streamed, "cluster": {"trainer_gpus": 2}, "trainer": {"streamed": True, "scale_down_at": 0.4}}):
        with pytest.raises(ConfigError, match="trainer.scale_down_at .* set trainer.streamed and leave "
                                              "cluster.trainer_gpus unset"):
            load_sim_config(small({"x": run}))


def test_resumed_versions_are_read_off_runs_not_token_by_token(monkeypatch):
    def refuse(self):
        raise AssertionError("iterated a Runs token by token")
    partial = {"name": "sorted", "control": {"sorted": {"mode": "partial", "max_versions": 2}}}
    busy = {"engine": {"max_seqs": 4}}  # requests wait and run long: updates abort some, resumed later
    expected = one(partial, **busy)
    assert expected["prompts"]["sorted/resumed"] > 0
    monkeypatch.setattr(Runs, "__iter__", refuse)
    r = one(partial, **busy)
    assert r["prompts"] == expected["prompts"] and r["step_time_s"] == expected["step_time_s"]
    assert run_lengths([3, 3, 4]) == [(3, 2), (4, 1)] and run_lengths(Runs([(1, 10**12)])) == [(1, 10**12)]


# 60 GB of weights and 1 MiB of KV a token: ~11k tokens of KV an engine at TP1, ~80k at TP2
KV_HUNGRY = {"params": 30e9, "layers": 64, "kv_heads": 32}


def test_planner_raises_tp_under_kv_pressure_and_preempts_less():
    # the trainer on 16 GPUs of its own, where its states fit; the 4 engines' KV is what is tested
    cfg = {"model": KV_HUNGRY, "steps": 6, "workload": {"max_tokens": 8192, "median_tokens": 2000, "sigma": 0.2},
           "reward": {"kinds": {"rule": {"share": 1, "median_s": 0.005}}}, "cluster": {"gpus": 20, "trainer_gpus": 16}}
    fixed = one({"name": "sync"}, **cfg)
    elastic = one({"name": "sync", "control": {"elastic_tp": {"enabled": True, "rule": "preemptions", "max_tp": 2}}}, **cfg)
    assert fixed["tp_per_step"] == [1] * 6 and min(fixed["preemptions_by_step"]) > 0
    tp = elastic["tp_per_step"]
    assert tp[0] == 1 and 2 in tp  # raised after a preempting round (and lowered again after calm ones)
    at_tp2 = [p for size, p in zip(tp, elastic["preemptions_by_step"]) if size == 2]
    assert max(at_tp2) < min(fixed["preemptions_by_step"])


def test_async_on_its_own_gpus_overlaps_rollout_and_training():
    own = {"cluster": {"gpus": 4, "tp": 1, "trainer_gpus": 2}, "trainer": {"overhead_s": 20.0}}
    lockstep = one({"name": "async", "control": {"staleness": {"eta": 0}}}, **own)
    overlapped = one({"name": "async", "control": {"staleness": {"eta": 1}}}, **own)
    # eta 0 waits for training before the next rollout; eta 1 rolls out meanwhile, hiding most of the 20 s
    assert lockstep["step_time_s"] >= lockstep["rollout_time_s"] + 20
    assert overlapped["step_time_s"] < lockstep["step_time_s"] - 10


def test_long_round_at_128_gpus_fits_the_kv_caches():
    """Tail's fifth round at 128 H800 is a long one (1,250 deferred prompts x 8): bounded by the engines'
    KV caches it pre-empts almost nothing; admitted all at once, thousands of samples are recomputed."""
    raw = yaml.safe_load((CONFIGS / "scale_128gpu.yaml").read_text())
    runs = {"bounded": {"name": "tail"}, "all-at-once": {"name": "tail", "control": {"tail": {"long_round_samples": 10**6}}}}
    raw.update(steps=5, schedulers=[{"label": k, **v} for k, v in runs.items()])
    results = simulate(raw, quiet=True)["results"]
    bounded, unbounded = (results[k] for k in runs)
    assert bounded["prompts"]["tail/long_rounds"] == 1 and bounded["prompts"]["tail/round"] == 1
    samples = 1250 * 8
    # almost nothing: the round holds its prompts' cut runaways, which run to the cap (rlsys/sim/workload.py)
    assert bounded["preemptions_by_step"][-1] <= 0.02 * samples
    assert unbounded["preemptions_by_step"][-1] > 0.3 * samples
