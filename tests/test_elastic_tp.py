"""Elastic rollout TP: the pure planner, then the simulator showing it follow KV pressure up and down."""
import subprocess
import sys

import pytest

from rlsys.sim.config import ElasticTPConfig, load_sim_config
from rlsys.control.elastic_tp import ElasticTP, plan_tp, tp_sizes
from rlsys import costs
from rlsys.costs import GPUS, MODELS, EngineCost
from rlsys.sim.run import simulate
from rlsys.sim.simulator import Simulation

PRESSURE, CALM = (100, 1000), (0, 1000)  # (preemptions, requests) of one round


def planner(tp=1, **cfg) -> ElasticTP:
    return ElasticTP(ElasticTPConfig(enabled=True, **{"max_tp": 4, "calm_rounds": 3, **cfg}), tp)


def test_pressure_doubles_tp_up_to_the_largest_size():
    p = planner()
    assert [p.observe(*PRESSURE) for _ in range(4)] == [2, 4, 4, 4]


def test_calm_rounds_halve_tp_one_size_at_a_time():
    p = planner(tp=4)
    assert [p.observe(*CALM) for _ in range(7)] == [4, 4, 2, 2, 2, 1, 1]


def test_a_round_between_the_thresholds_restarts_the_calm_count():
    p = planner(tp=2, raise_at=0.05, lower_at=0.01)
    p.observe(*CALM)
    p.observe(*CALM)
    assert p.observe(20, 1000) == 2  # 2%: neither pressure nor calm
    assert [p.observe(*CALM) for _ in range(3)] == [2, 2, 1]


def test_lowering_that_brings_pressure_back_backs_off():
    p = planner(tp=2)
    for _ in range(3):
        p.observe(*CALM)
    assert p.tp == 1
    assert p.observe(*PRESSURE) == 2 and p.need_calm == 6  # the lowering was regretted: wait longer
    assert [p.observe(*CALM) for _ in range(6)] == [2] * 5 + [1]


def test_state_dict_resumes_the_same_decisions():
    rounds = [PRESSURE, CALM, CALM, (5, 1000), CALM, CALM, CALM, PRESSURE, CALM]
    a = planner()
    for r in rounds[:4]:
        a.observe(*r)
    b = planner()
    b.load_state_dict(a.state_dict())
    assert [a.observe(*r) for r in rounds[4:]] == [b.observe(*r) for r in rounds[4:]]


def test_sizes_and_a_start_outside_them():
    assert tp_sizes(1, 8) == [1, 2, 4, 8] and tp_sizes(2, 6) == [2, 4]
    with pytest.raises(ValueError, match="starting TP size 3"):
        planner(tp=3)
    with pytest.raises(ValueError, match="min_tp <= max_tp"):
        ElasticTPConfig(min_tp=4, max_tp=2)
    assert ElasticTP(ElasticTPConfig(), 2, allowed=[1, 2]).observe(*PRESSURE) == 2  # nowhere larger to go


def test_the_planner_imports_neither_torch_nor_ray():
    code = "import sys, rlsys.control.elastic_tp; print(sorted({'torch', 'ray', 'vllm'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


# --- in the simulator ----------------------------------------------------------------------------
def sim(median_tokens: float, tp: int, elastic: bool, steps: int = 8) -> dict:
    """Qwen2.5-7B on 8 H800 with vLLM's memory share cut to 0.3, so KV room is scarce. Per engine at TP1:
    0.3 x 80 GB - 15.2 GB of weights = 8.8 GB over 56 KiB a token, 0.15 M tokens; at TP2 each GPU holds
    half the weights and half the KV heads: (24 - 7.6) GB over 28 KiB, 0.57 M; at TP4, 1.4 M. A step
    runs 128 prompts x 8 samples, so at TP1 each engine holds 128 sequences of ~4.4k tokens (~0.56 M)."""
    cfg = {"name": "elastic", "steps": steps, "model": "qwen2.5-7b",
           "cluster": {"gpus": 8, "tp": tp}, "engine": {"memory_fraction": 0.3},
           "workload": {"max_tokens": 8192, "median_tokens": median_tokens, "sigma": 0.5},
           "control": {"prompts_per_step": 128, "group_size": 8,
                       "elastic_tp": {"enabled": elastic, "rule": "preemptions", "max_tp": 4, "calm_rounds": 2}}}
    return simulate(cfg, quiet=True)["results"]["sync"]


def test_simulated_kv_pressure_raises_tp_and_cuts_preemptions():
    fixed, elastic = sim(4000, tp=1, elastic=False), sim(4000, tp=1, elastic=True)
    assert fixed["preemptions_per_step"] > 0 and fixed["recomputed_tokens_per_step"] > 0
    assert elastic["tp_per_step"][0] == 1 and max(elastic["tp_per_step"]) >= 2
    late = elastic["preemptions_by_step"][-3:]
    assert sum(late) < sum(fixed["preemptions_by_step"][-3:]) / 4
    assert elastic["step_time_s"] < fixed["step_time_s"]


def test_simulated_tp_comes_back_down_without_kv_pressure():
    calm = sim(300, tp=4, elastic=True)
    assert sum(calm["preemptions_by_step"]) == 0
    assert calm["tp_per_step"][0] == 4 and calm["tp_per_step"][-1] == 1


def test_a_starting_tp_elastic_tp_may_not_use_is_refused():
    from rlsys.config import ConfigError
    from rlsys.sim.config import load_sim_config

    base = {"model": "qwen2.5-7b", "cluster": {"gpus": 8, "tp": 8}, "control": {"elastic_tp": {"enabled": True}}}
    load_sim_config(base)
    base["control"]["elastic_tp"]["max_tp"] = 4
    with pytest.raises(ConfigError, match=r"cluster.tp=8 is not a size control.elastic_tp may use: \[1, 2, 4\]"):
        load_sim_config(base)


def test_the_shipped_elastic_config_loads():
    from pathlib import Path

    from rlsys.sim.config import load_sim_config

    cfg = load_sim_config(Path(__file__).resolve().parent.parent / "configs" / "sim" / "elastic_tp.yaml")
    assert [r.label for r in cfg.runs()] == ["sync", "sync_tp2", "sync_elastic"]


def test_live_training_refuses_elastic_tp_which_only_the_simulator_models():
    from rlsys.config import DEFAULT_CONFIG, ConfigError
    from rlsys.startup import load_config

    with pytest.raises(ConfigError, match="control.elastic_tp: unknown key"):
        load_config(DEFAULT_CONFIG, ["control.elastic_tp.enabled=true"])


def test_the_round_planner_sizes_tp_from_the_rounds_lengths():
    """7B on 64 H800: a round of 1,024 short samples waits on its longest, so the largest TP (fastest per
    token) wins; a long round of 10,000 long samples is bound by throughput, so fewer GPUs per engine win: TP2
    for its KV room if TP split perfectly, TP1 at the fitted TP efficiency (TP2's steps 6% slower per GPU)."""
    def plan(efficiency=costs.TP_EFFICIENCY):
        sizes = {tp: EngineCost.build(MODELS["qwen2.5-7b"], GPUS["h800"], tp, tp_efficiency=efficiency)
                 for tp in (1, 2, 4, 8)}
        short = plan_tp(sizes, 64, samples=1024, mean_tokens=800, longest=4000, prompt_tokens=300, max_seqs=256)
        long = plan_tp(sizes, 64, samples=10000, mean_tokens=12000, longest=32768, prompt_tokens=300, max_seqs=256)
        return short, long

    assert plan() == (8, 1) and plan(efficiency=1.0) == (8, 2)


def test_the_simulated_planner_acts_before_each_round():
    """Under tail with the round rule the first round runs the configured TP (nothing is known yet), then the
    planner moves TP without a single preemption to react to: short rounds up, the long round kept at the
    configured TP (RollPacker measured long rounds slower at the larger TP; the cost model alone picks TP4)."""
    cfg = {"name": "planner", "steps": 6, "model": "qwen2.5-7b", "cluster": {"gpus": 8, "tp": 1},
           "workload": {"max_tokens": 8192, "median_tokens": 600},
           "control": {"prompts_per_step": 32, "group_size": 8, "elastic_tp": {"enabled": True, "max_tp": 4}},
           "schedulers": ["tail"]}
    r = simulate(cfg, quiet=True)["results"]["tail"]
    assert r["tp_per_step"][0] == 1 and max(r["tp_per_step"]) > 1 and sum(r["preemptions_by_step"]) == 0
    assert r["long_round_steps"] == [4] and r["tp_per_step"][4] == 1 and r["tp_per_step"][1:4] == [4, 4, 4]


def test_engines_retired_by_a_tp_change_hold_no_more_gpu_time():
    """After a TP change the old engines' GPUs belong to the new ones: allocated GPU-seconds over all engines,
    retired ones included, stay within the rollout GPUs' time (retired engines advanced at every finish once
    counted as idle GPUs, which a streamed trainer then borrowed)."""
    cfg = load_sim_config({"name": "planner", "steps": 6, "model": "qwen2.5-7b", "cluster": {"gpus": 8, "tp": 1},
                           "workload": {"max_tokens": 8192, "median_tokens": 600},
                           "control": {"prompts_per_step": 32, "group_size": 8,
                                       "elastic_tp": {"enabled": True, "max_tp": 4}},
                           "schedulers": ["tail"]})
    sim = Simulation(cfg, cfg.runs()[0])
    r = sim.run()
    assert sim.retired, "the planner changed TP"
    assert sum(e.gpus * e.alloc_s for e in sim._all_engines()) <= 8 * r["sim_time_s"] * (1 + 1e-9)
