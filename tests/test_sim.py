"""The cluster simulator: cost model, workload, engine accounting, determinism and config errors."""
import json
import math
import statistics
from pathlib import Path

import pytest

from rlsys import costs
from rlsys.config import ConfigError
from rlsys.control.actions import Abort, Train
from rlsys.control.metrics import bubble_ratio
from rlsys.control.scheduler import GroupBuilder, Scheduler
from rlsys.costs import GPUS, MODELS, EngineCost
from rlsys.sim.config import RewardSpec, SchedulerRun, WorkloadSpec, load_sim_config
from rlsys.sim.engine import SimEngine, SimRequest, SlotMark, slot_seconds_at
from rlsys.sim.run import format_table, main, simulate
from rlsys.sim.simulator import Simulation
from rlsys.sim.workload import SampleDraw, Workload
from rlsys.types import Prompt, Request

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"


def small(**extra):
    """A workload small enough to simulate in well under a second."""
    cfg = {"name": "small", "steps": 3, "model": "qwen2.5-1.5b",
           "cluster": {"gpus": 4, "tp": 1}, "workload": {"max_tokens": 4096, "median_tokens": 600},
           "control": {"prompts_per_step": 16, "group_size": 4}}
    cfg.update(extra)
    return cfg


def without_wall(report):
    return {k: {kk: vv for kk, vv in v.items() if kk != "wall"} for k, v in report["results"].items()}


# --- cost model ------------------------------------------------------------------------------
@pytest.mark.parametrize("model, tp, weight_ms, capacity_m", [
    ("qwen2.5-7b", 1, 6.1, 0.99), ("qwen2.5-14b", 2, 5.9, 0.58), ("qwen2.5-32b", 2, 12.9, 0.30)])
def test_engine_constants_match_calibration_table(model, tp, weight_ms, capacity_m):
    cost = EngineCost.build(MODELS[model], GPUS["h800"], tp, overhead_s=0.0, tp_efficiency=1.0)  # the table's ideal split
    assert cost.weight_s * 1e3 == pytest.approx(weight_ms, rel=0.03)
    assert cost.kv_capacity / 1e6 == pytest.approx(capacity_m, rel=0.03)
    full = cost.step_s(64, cost.kv_capacity)  # published: ~24-28 ms with a full KV cache (docs/performance.md)
    assert 0.022 < full < 0.030


def test_tp_efficiency_slows_each_doubling_and_leaves_tp1_alone():
    shape, gpu = MODELS["qwen2.5-32b"], GPUS["h800"]
    for tp in (1, 2, 4, 8):
        ideal, real = (EngineCost.build(shape, gpu, tp, tp_efficiency=e) for e in (1.0, 0.8))
        slow = 0.8 ** -{1: 0, 2: 1, 4: 2, 8: 3}[tp]
        for field in ("weight_s", "kv_s_per_token", "compute_s_per_seq"):
            assert getattr(real, field) == pytest.approx(slow * getattr(ideal, field))
        assert (real.kv_capacity, real.overhead_s) == (ideal.kv_capacity, ideal.overhead_s)  # memory is split alike
    assert costs.TP_EFFICIENCY < 1


def test_tp_efficiency_is_the_calibration_fit():
    fit = json.loads((RESULTS / "sim_calibration.json").read_text())["tp_fit"]
    assert fit["fitted"] and fit["tp_efficiency"] == fit["in_costs"] == costs.TP_EFFICIENCY


def test_decode_step_grows_with_live_tokens():
    cost = EngineCost.build(MODELS["qwen2.5-7b"], GPUS["h100"], 1)
    steps = [cost.step_s(32, kv) for kv in (0, 1e4, 1e5, 5e5)]
    assert steps == sorted(steps) and steps[-1] > 2 * steps[0]


def test_engine_generates_slower_with_longer_context():
    cost = EngineCost.build(MODELS["qwen2.5-7b"], GPUS["h100"], 1)

    def finish_time(prompt_tokens):
        engine = SimEngine(0, cost, max_seqs=8, watermark=0.0, slots=8)
        req = SimRequest("r", Prompt("p", "", ""), prompt_tokens, SampleDraw(2000, False, 1.0, 0.0), 0.0)
        engine.enqueue(req)
        assert engine.settle(0.0) == []
        t, progress = engine.next_event()
        engine.advance_to(t, progress)
        assert engine.settle(t) == [req] and req.done == 2000
        return t

    short, long = finish_time(100), finish_time(200_000)
    assert long > 1.5 * short


def test_a_padded_engine_decodes_a_batch_at_its_longest_sequences_cost():
    """The built-in engine's cost (attention padded to the longest sequence's key bucket): one long prompt among
    short ones makes the batch as slow as all long; vLLM's paged cost charges the live KV, far less."""
    def decode_s(cost, prompts):
        engine = SimEngine(0, cost, max_seqs=8, watermark=0.0, slots=8)
        for i, tokens in enumerate(prompts):
            engine.enqueue(SimRequest(f"r{i}", Prompt("p", "", ""), tokens, SampleDraw(50, False, 1.0, 0.0), 0.0))
        engine.settle(0.0)
        return engine.next_event()[0] - engine.prefill_until  # the 50 decode steps, prefill left out

    skewed, long, short = [4000] + [100] * 7, [4000] * 8, [100] * 8
    padded = EngineCost.build(MODELS["qwen2.5-1.5b"], GPUS["h100"], 1, **costs.BUILTIN_ENGINE, max_len=4096 + 64)
    assert decode_s(padded, skewed) == decode_s(padded, long) > 2 * decode_s(padded, short)
    paged = EngineCost.build(MODELS["qwen2.5-1.5b"], GPUS["h100"], 1)
    assert decode_s(paged, skewed) - decode_s(paged, short) < (decode_s(paged, long) - decode_s(paged, short)) / 4


def test_slot_seconds_read_at_a_time_equal_running_the_engines_to_it():
    """The read at every sample's finish counts what advance_to would: busy slots while running, none while the
    trainer holds a paused engine, and adds to the totals it is given."""
    cost = EngineCost.build(MODELS["qwen2.5-7b"], GPUS["h100"], 1)
    engines = [SimEngine(i, cost, max_seqs=8, watermark=0.0, slots=4) for i in range(3)]
    for engine, running in zip(engines, (2, 6, 0)):  # under, over and without the counted slots
        for k in range(running):
            engine.enqueue(SimRequest(f"r{k}", Prompt(f"p{k}", "", ""), 100, SampleDraw(5000, False, 1.0, 0.0), 0.0))
        engine.settle(0.0)
    engines[0].advance_to(0.5)
    engines[2].pause(0.5, 3.0)  # training past the read
    read = slot_seconds_at(engines, 2.0, 10.0, 20.0)
    for engine in engines:
        engine.advance_to(2.0)
    assert read == (10.0 + sum(e.busy_slot_s for e in engines), 20.0 + sum(e.slots * e.alloc_s for e in engines))
    assert read[0] == pytest.approx(10.0 + 2.0 * 2 + 4 * 2.0)  # min(running, slots) x seconds; the paused one idle



def test_slot_mark_reads_what_the_engines_held_at_the_mark_after_they_ran_past_it():
    """The last finish's count, taken lazily: engines that ran on past the mark (a batch changed, a pause) keep
    their count at it, the others are read at the end; the sum is the one read at the mark, to the bit."""
    cost = EngineCost.build(MODELS["qwen2.5-7b"], GPUS["h100"], 1)
    mark = SlotMark()
    engines = [SimEngine(i, cost, max_seqs=8, watermark=0.0, slots=4) for i in range(3)]
    request = lambda k: SimRequest(f"r{k}", Prompt(f"p{k}", "", ""), 100, SampleDraw(5000, False, 1.0, 0.0), 0.0)  # noqa: E731
    for engine, running in zip(engines, (2, 6, 0)):
        engine.mark = mark
        for k in range(running):
            engine.enqueue(request(k))
        engine.settle(0.0)
    engines[1].advance_to(0.7)
    then = slot_seconds_at(engines, 1.0, 3.0, 4.0)
    mark.set(1.0, engines, 3.0, 4.0)
    engines[0].advance_to(1.5)
    engines[0].enqueue(request(9))
    engines[0].settle(1.5)
    engines[2].pause(1.2, 3.0)
    engines[1].advance_to(2.5)
    assert mark.read() == then

def test_kv_full_engine_preempts_and_still_finishes_everything():
    cfg = small(engine={"memory_fraction": 0.06}, workload={"max_tokens": 4096, "median_tokens": 2000},
                control={"prompts_per_step": 32, "group_size": 8})
    r = simulate(cfg, quiet=True)["results"]["sync"]
    assert r["preemptions_per_step"] > 0 and r["kv_utilization"] > 0.5
    assert r["requests"]["submitted"] == r["requests"]["finished"] == 3 * 32 * 8


# --- workload ------------------------------------------------------------------------------
def draws(spec, prompts=400, per_prompt=8):
    work = Workload(spec, RewardSpec(), seed=0)
    return [[d.length for d in work.samples(p, 0, per_prompt)] for p in work.prompts()[:prompts]]


def test_lengths_are_heavy_tailed_with_a_truncated_share():
    spec = WorkloadSpec(max_tokens=8192, median_tokens=1200, sigma=0.9, runaway_share=0.01)
    flat = [n for g in draws(spec) for n in g]
    median = statistics.median(flat)
    p99 = sorted(flat)[int(0.99 * len(flat))]
    truncated = sum(n >= 8192 for n in flat) / len(flat)
    assert 900 < median < 1600
    assert p99 / median > 5
    assert 0.01 < truncated < 0.08  # "a few %"
    assert max(flat) == 8192


def test_prompt_identity_explains_most_of_the_length_variance():
    spec = WorkloadSpec(max_tokens=10**7, median_tokens=1000, sigma=1.0, prompt_share=0.65, runaway_share=0.0)
    groups = [[math.log(n) for n in g] for g in draws(spec, prompts=600, per_prompt=16)]
    within = statistics.mean(statistics.pvariance(g) for g in groups)
    total = statistics.pvariance([x for g in groups for x in g])
    assert 1 - within / total == pytest.approx(0.65, abs=0.06)


def test_same_prompt_and_ordinal_give_the_same_sample():
    work = Workload(WorkloadSpec(), RewardSpec(), seed=3)
    p = work.prompts()[5]
    assert work.samples(p, 0, 8)[:4] == work.samples(p, 0, 4)
    cut = work.samples(p, 0, 1)[0]
    assert work.resumed(p, 3, done=cut.length // 2, cut=cut) == cut  # the same sample goes on
    assert work.resumed(p, 3, done=cut.length, cut=cut).length == cut.length + 1  # never shorter than it is
    # a replacement of a cut runaway runs away; its other draws, and the others', are those of its ordinal
    forced, plain = work.samples(p, 0, 8, runaway_at={2}), work.samples(p, 0, 8)
    assert forced[2].length == WorkloadSpec().max_tokens and forced[2].truncated and forced[2].reward == 0.0
    assert forced[2].reward_latency == plain[2].reward_latency and forced[:2] + forced[3:] == plain[:2] + plain[3:]


# --- whole runs ---------------------------------------------------------------------------------
def test_same_seed_gives_the_same_json(tmp_path):
    a = simulate(small(), tmp_path / "a.json", quiet=True)
    b = simulate(small(), tmp_path / "b.json", quiet=True)
    assert json.dumps(without_wall(a)) == json.dumps(without_wall(b))
    c = simulate(small(seed=1), quiet=True)
    assert without_wall(c) != without_wall(a)
    written = json.loads((tmp_path / "a.json").read_text())
    assert written["results"]["sync"]["speedup_vs_sync"] == 1.0


def test_time_is_monotonic_and_requests_are_accounted_once():
    cfg = load_sim_config(small(steps=4))
    sim = Simulation(cfg, cfg.runs()[0])
    trace = []
    r = sim.run(trace)
    times = [t for t, _ in trace]
    assert times == sorted(times)
    assert r["requests"]["submitted"] == r["requests"]["finished"] == 4 * 16 * 4
    assert r["steps"] == 4 and r["trained_prompts"] == 64
    assert r["step_time_s"] > r["rollout_time_s"] > 0 and r["train_time_s"] > 0
    assert 0 <= r["bubble_ratio"] < 1 and 0 <= r["straggler_rate"] <= 1
    assert r["wall"]["controller_calls"] > r["requests"]["finished"]  # every completion went through the timer


def test_bubble_ratio_agrees_with_the_control_metric():
    cfg = load_sim_config(small(steps=1))
    sim = Simulation(cfg, cfg.runs()[0])
    seen = []
    on_sample = sim.scheduler.on_sample
    sim.scheduler.on_sample = lambda s, now: seen.append(s.completion) or on_sample(s, now)
    handovers, train = [], sim._train
    sim._train = lambda action, touched: handovers.append(sim.now) or train(action, touched)
    r = sim.run()
    capacity = sum(e.slots for e in sim.engines)
    expected = bubble_ratio(seen, capacity, 0.0, handovers[0])  # the engines are allocated until the handover
    assert r["bubble_ratio"] == pytest.approx(expected, rel=1e-6)


class Speculative(Scheduler):
    """A tail-batching sketch: launch 2 extra samples per prompt and 2 extra prompts, keep the
    first `group_size` samples of the first `prompts_per_step` prompts, abort the rest."""

    def start(self, now):
        self.pending, self.done = {}, []
        out = []
        for prompt in self.draw(self.cfg.prompts_per_step + 2):
            self.pending[prompt.uid] = GroupBuilder(prompt, self.cfg.group_size)
            out.append(self.submit(prompt, self.cfg.group_size + 2))
        return out

    def on_sample(self, sample, now):
        uid = self.finish(sample.completion.request_id)
        if uid is None or uid not in self.pending:
            return []
        builder = self.pending[uid]
        builder.add(sample)
        if not builder.complete:
            return []
        del self.pending[uid]
        self.done.append(builder.group())
        out = [Abort(self._forget(lambda prompt_uid: prompt_uid == uid))]
        if len(self.done) == self.cfg.prompts_per_step:
            self.ledger.drop("aborted", len(self.pending))
            self.pending = {}
            out += [Abort(self._forget(lambda prompt_uid: True)), Train(self.done)]
            self.ledger.train(len(self.done))
        return out

    def _forget(self, match):
        ids = [rid for rid, prompt_uid in self.prompt_of.items() if match(prompt_uid)]
        for rid in ids:
            self.finish(rid)
        return ids

    def in_flight_prompts(self):
        return len(self.pending)


def test_aborts_free_engines_and_every_request_ends_once():
    cfg = load_sim_config(small(steps=4, engine={"max_seqs": 4}))  # some requests wait, some run
    sim = Simulation(cfg, cfg.runs()[0])
    sim.scheduler = Speculative(sim.scheduler.cfg, sim.scheduler.cursor, sim.scheduler.sizer)
    partial = []
    sim.scheduler.on_abort = lambda c, now: partial.append(c) or []
    r = sim.run()
    req = r["requests"]
    assert req["aborted"] > 0 and len(partial) == req["aborted"]  # each abort reported back once
    assert all(c.finish_reason == "abort" and len(c.versions) == c.num_tokens for c in partial)
    assert any(c.num_tokens > 0 for c in partial) and any(c.num_tokens == 0 for c in partial)
    assert req["submitted"] == req["finished"] + req["aborted"] == 4 * 18 * 6
    assert r["trained_prompts"] == 4 * 16 and r["wasted_token_share"] > 0
    assert all(e.load == 0 and e.n == 0 for e in sim.engines)


class OneLongSample(Scheduler):
    """One resumed sample that keeps generating while the trainer publishes new weights."""

    def start(self, now):
        if self.version:  # after a step: nothing more to ask
            return []
        prompt = self.draw(1)[0]
        action = self.submit(prompt, 1)
        rid = action.request_ids[0]
        action.resume[rid] = Request(rid, prompt.uid, [], resume_ids=[7] * 100, resume_versions=[0] * 100)
        return [action, Train([])]

    def on_sample(self, sample, now):
        self.sample = sample
        self.finish(sample.completion.request_id)
        self.ledger.drop("sketch")
        return [Train([])]


    def in_flight_prompts(self):
        return len(self.prompt_of)


def test_weight_updates_mid_generation_split_token_versions():
    cfg = load_sim_config(small(steps=2, cluster={"gpus": 2, "tp": 1, "trainer_gpus": 1},
                                workload={"max_tokens": 4096, "median_tokens": 3000, "sigma": 0.0,
                                          "runaway_share": 0.0},
                                trainer={"overhead_s": 1.0}))
    sim = Simulation(cfg, cfg.runs()[0])
    sim.scheduler = OneLongSample(sim.scheduler.cfg, sim.scheduler.cursor, sim.scheduler.sizer)
    sim.run()
    c = sim.scheduler.sample.completion
    assert c.num_tokens == len(c.versions) == 3000
    runs = c.versions.runs
    assert [v for v, _ in runs] == [0, 1] and runs[0][1] > 100


def test_tail_batching_runs_unchanged_and_beats_sync():
    """At the 7B config's median, far below the cap (TailSieve's 1,160 tokens, the calibration's cited length), the
    8k tail is long, and tail batching gains. It over-draws whole prompts only, and a prompt's slowest of its 8
    samples is near the tail of them all: at eta_p 1.25 it about matches sync here (1.00x), at 1.5 it gains."""
    cfg = load_sim_config(CONFIGS / "qwen7b_8k.yaml")
    assert cfg.workload.median_tokens == 1160
    tail = SchedulerRun(name="tail", control={"tail": {"eta_p": 1.5}})
    cfg = cfg.model_copy(update={"steps": 5, "schedulers": ["sync", tail]})
    r = simulate(cfg, quiet=True)["results"]
    assert r["tail"]["speedup_vs_sync"] > 1.05
    assert r["tail"]["bubble_ratio"] < r["sync"]["bubble_ratio"]
    assert r["tail"]["requests"]["aborted"] > 0 and r["tail"]["trained_prompts"] == 5 * 128


def test_group_size_costs_time_only_where_a_group_gates_its_training():
    """docs/performance.md "Where group size costs wall time": a sync step of fixed samples waits for the slowest of all
    of them whatever G is; sorted trains a group when its slowest sample ends."""
    cfg = load_sim_config(CONFIGS / "sagc_7b_8k.yaml")
    runs = [r for r in cfg.runs() if r.label in ("sync-G4", "sync-G16", "sorted-G4", "sorted-G16")]
    r = simulate(cfg.model_copy(update={"steps": 5, "schedulers": runs}), quiet=True)["results"]
    step = {label: figures["step_time_s"] for label, figures in r.items()}
    assert r["sync-G16"]["straggler_rate"] > 2 * r["sync-G4"]["straggler_rate"]
    assert abs(step["sync-G16"] / step["sync-G4"] - 1) < 0.05
    assert step["sorted-G16"] > 1.1 * step["sorted-G4"]


# --- configs and CLI -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen7b_8k", "qwen32b_32k", "scale_128gpu", "sagc_7b_8k"])
def test_shipped_configs_load(name):
    cfg = load_sim_config(CONFIGS / f"{name}.yaml")
    assert "sync" in [r.name for r in cfg.runs()]


def test_shipped_scale_config_matches_its_brief():
    cfg = load_sim_config(CONFIGS / "scale_128gpu.yaml")
    assert cfg.cluster.gpus == 128 and cfg.steps == 50 and cfg.workload.max_tokens == 32768
    assert cfg.control.prompts_per_step * cfg.control.group_size == 10_000


@pytest.mark.parametrize("patch, field", [
    ({"workload": {"sigmaa": 1}}, "workload.sigmaa"),
    ({"cluster": {"gpus": "many"}}, "cluster.gpus"),
    ({"engine": {"kv_watermark": 2}}, "engine.kv_watermark"),
    ({"model": "qwen9-3b"}, "qwen9-3b"),
    ({"schedulers": [{"name": "sync", "control": {"group_sze": 4}}]}, "schedulers[0].control"),
    ({"cluster": {"gpus": 3, "tp": 2}}, "tp=2"),
])
def test_config_errors_name_the_field(patch, field):
    with pytest.raises(ConfigError) as err:
        load_sim_config(small(**patch))
    assert field in str(err.value)


def test_config_errors_point_at_the_yaml_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nworkload:\n  median_tokens: -5\n")
    with pytest.raises(ConfigError, match=r"workload.median_tokens.*line 3"):
        load_sim_config(path)


def test_unknown_schedulers_are_skipped_with_a_note(capsys):
    report = simulate(small(schedulers=["sync", "not-yet-written"]))
    assert list(report["results"]) == ["sync"]
    assert "not-yet-written" in report["skipped"]
    out = capsys.readouterr().out
    assert "skipping not-yet-written" in out and "speedup" in out


def test_cli_writes_json(tmp_path, capsys):
    import yaml
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small()))
    assert main([str(path), "--output", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["results"]["sync"]["steps"] == 3
    assert main([str(tmp_path / "missing.yaml")]) == 2


def test_a_quick_run_prints_its_table():
    # How fast it runs is a target of benchmarks/controller_load.py, not a test on a shared machine.
    report = simulate(small(steps=5, control={"prompts_per_step": 64, "group_size": 8}), quiet=True)
    assert report["results"]["sync"]["steps"] == 5 and "sync" in format_table(report)
