"""Per-step rollout windows: sync restarts the window after training, overlapped schedulers carry it on, in the
live run and the simulator alike."""
import pytest

from rlsys import step_stats
from rlsys.rollout.engine import EngineCounters
from rlsys.step_stats import StepStats, tokens_within
from rlsys.types import Completion, Group, Prompt, ScoredSample


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(step_stats.time, "time", c)
    return c


def done(rid, start, end, tokens=10, reason="stop"):
    c = Completion(rid, "p", [1], [2] * tokens, [0.0] * tokens, [0] * tokens, reason)
    c.start_time, c.end_time = start, end
    return c


def group(*completions):
    return [Group(Prompt("p", "", ""), [ScoredSample(c, 1.0) for c in completions])]


class Engine:
    """One engine's counters, fed decode steps at the fake clock's times."""
    def __init__(self, clock, tokens_per_s=10.0):
        self.clock, self.counters, self.tokens_per_s = clock, EngineCounters(), tokens_per_s

    def decode(self, start, end, active, dt=0.5):
        t = start
        while t < end - 1e-9:
            self.clock.t = t + dt
            self.counters.record(active, slots=2, new_tokens=active, elapsed=dt)
            t += dt

    def stats(self, window):
        return [{"saturated_tokens_per_s": self.tokens_per_s, "occupied_slot_s": self.counters.occupied_slot_s(*window),
                 "busy_s_in_window": self.counters.busy_s_within(*window),
                 "decode_steps_in_window": self.counters.decode_steps_within(*window)}]


def test_occupancy_counts_only_the_part_of_each_step_inside_the_window(clock):
    engine = Engine(clock)
    engine.decode(0, 4, active=2, dt=1.0)  # steps ending at 1, 2, 3, 4
    engine.decode(4, 6, active=1, dt=1.0)
    assert engine.counters.occupied_slot_s(1.5, 5.0) == pytest.approx(0.5 * 2 + 2 * 2 + 1)
    assert engine.counters.occupied_slot_s(6.0, 9.0) == 0.0


def test_engine_pace_tells_a_slow_step_from_a_thread_kept_from_stepping(clock):
    """rollout/decode_step_ms is the engine's own time per step; rollout/engine_busy_share the window's share it
    stepped: 4 steps of 0.5 s spread over a 4 s window step at 500 ms, half the time."""
    engine = Engine(clock)
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=engine.stats)
    for t in (100.5, 101.5, 102.5, 103.5):  # each step ends 0.5 s after the last: the thread waited between them
        clock.t = t
        engine.counters.record(2, slots=2, new_tokens=2, elapsed=0.5)
    a = done("a", 100, 104, tokens=4)
    stats.add_completion(a)
    clock.t = 104
    metrics = stats.close_rollout(group(a))
    assert metrics["rollout/decode_steps"] == 4
    assert metrics["rollout/decode_step_ms"] == pytest.approx(500.0)
    assert metrics["rollout/engine_busy_share"] == pytest.approx(0.5)


def test_aborted_extras_after_the_handover_do_not_stretch_the_next_window(clock):
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=Engine(clock).stats)
    a, b = done("a", 100, 101), done("b", 100, 102)
    stats.add_completion(a), stats.add_completion(b)
    clock.t = 102
    stats.close_rollout(group(a, b))
    stats.add_completion(done("x", 100, 102.1, reason="abort"))  # tail's extra, cut at the handover
    clock.t = 105  # training took 3 s
    assert stats.step_totals()["timing/step_s"] == pytest.approx(5.0)
    stats.start_step()
    assert stats.t_start == 105  # sync and tail: the engines sat idle while the trainer ran


def test_overlapped_generation_carries_the_window_and_counts_training_once(clock):
    engine = Engine(clock, tokens_per_s=5.0)
    stats = StepStats(kappa=2.0, capacity=1, engine_stats=engine.stats)
    a = done("a", 100, 102)
    engine.decode(100, 102, active=1)
    stats.add_completion(a)
    stats.close_rollout(group(a))
    b = done("b", 102, 104)  # finished while the trainer ran (async, sorted)
    engine.decode(102, 104, active=1)
    stats.add_completion(b)
    clock.t = 104
    assert stats.step_totals()["timing/step_s"] == pytest.approx(4.0)
    stats.start_step()
    assert stats.t_start == 102
    clock.t = 106
    metrics = stats.close_rollout(group(b))
    assert metrics["rollout/bubble_ratio"] == pytest.approx(0.0)  # one slot, busy from 102 to 104
    assert metrics["rollout/efficiency"] == pytest.approx(1.0)  # 10 tokens in 2 s at 5 tokens/s
    clock.t = 107
    assert stats.step_totals()["timing/step_s"] == pytest.approx(3.0)  # publish to publish


def test_tokens_within_counts_only_the_share_inside_the_window():
    runs = [done("a", 0, 10, tokens=10), done("b", 5, 6, tokens=4), done("c", 20, 30, tokens=5)]
    assert tokens_within(runs, 5, 10) == pytest.approx(5 + 4)


def test_requests_still_generating_at_the_handover_count_as_busy(clock):
    """sorted, tail: the handover cuts requests that never finish in this window; the engine was full."""
    engine = Engine(clock)
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=engine.stats)
    engine.decode(100, 104, active=2)  # one request finishes at 104, the other runs on and is aborted
    a = done("a", 100, 104)
    stats.add_completion(a)
    assert stats.close_rollout(group(a))["rollout/bubble_ratio"] == pytest.approx(0.0)


def test_a_sample_collected_after_the_handover_but_finished_before_it_does_not_carry_the_window(clock):
    """sorted: samples that finished as the Train was decided arrive late; the engine sat idle in training."""
    engine = Engine(clock)
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=engine.stats)
    a = done("a", 100, 101.5)
    engine.decode(100, 102, active=2)
    stats.add_completion(a)
    stats.close_rollout(group(a))
    stats.add_completion(done("late", 100, 101.9))  # finished before the handover at 102, collected after
    clock.t = 105
    stats.start_step()
    assert stats.t_start == 105


def test_generating_share_is_the_decoding_time_inside_a_train_step(clock):
    engine = Engine(clock)
    engine.decode(100, 102, active=2, dt=1.0)  # busy 100-102, idle after
    engine.decode(103, 104, active=1, dt=1.0)  # busy again 103-104, one slot only: still busy
    assert engine.counters.busy_s_within(101.5, 103.5) == pytest.approx(0.5 + 0.5)
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=engine.stats)
    assert stats.generating_share(101.5, 103.5) == pytest.approx(0.5)
    assert stats.generating_share(104.0, 106.0) == 0.0  # sync: the engines sat idle while the trainer ran


def test_step_time_is_read_on_the_step_clock_which_leaves_evaluation_out(clock):
    training_clock = Clock()
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=Engine(clock).stats, step_clock=training_clock)
    clock.t, training_clock.t = 110, 102  # 10 s of wall time, 8 of them an evaluation
    assert stats.step_totals()["timing/step_s"] == pytest.approx(2.0)


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_the_simulator_opens_each_rollout_window_as_the_live_run_does(scheduler):
    """At the step boundary, or, where the engines went on generating through the train step (async, eta 2 keeps
    them busy), at the last handover to training: then the window spans the training it overlapped."""
    from rlsys.sim.config import load_sim_config
    from rlsys.sim.simulator import Simulation

    cfg = load_sim_config({"model": "qwen2.5-7b", "steps": 6, "schedulers": [scheduler],
                           "cluster": {"gpu": "h100", "gpus": 4, "trainer_gpus": 2},
                           "workload": {"max_tokens": 2048, "dataset_size": 512},
                           "control": {"prompts_per_step": 8, "group_size": 4, "staleness": {"eta": 2}}})
    sim = Simulation(cfg, cfg.runs()[0])
    starts, handovers, train = [], [], sim._train

    def recording_train(action, touched):
        starts.append(sim.step_start)
        handovers.append(sim.now)
        train(action, touched)
    sim._train = recording_train
    sim.run()
    if scheduler == "async":
        boundaries = sim.step_ends
        assert all(start in (handover, boundary) for start, handover, boundary in zip(starts[1:], handovers, boundaries))
        assert any(start == handover < boundary for start, handover, boundary in zip(starts[1:], handovers, boundaries))
    else:  # nothing generates while training: the window opens once the last step's weights are loaded
        assert starts == pytest.approx([0.0] + sim.step_ends[:-1])


def test_the_simulators_rollout_bubble_counts_only_the_rollout_windows():
    """Sync with a trainer of its own GPUs: its engines idle through each train step, which the run's bubble
    counts and the live metric's windows leave out."""
    from rlsys.sim.config import load_sim_config
    from rlsys.sim.simulator import Simulation

    cfg = load_sim_config({"model": "qwen2.5-7b", "steps": 4, "cluster": {"gpu": "h100", "gpus": 4, "trainer_gpus": 2},
                           "workload": {"max_tokens": 2048, "dataset_size": 512},
                           "control": {"prompts_per_step": 8, "group_size": 4}})
    sim = Simulation(cfg, cfg.runs()[0])
    result = sim.run()
    busy = sum(e.busy_slot_s for e in sim.engines)
    windows = sum(e.slots for e in sim.engines) * sum(sim.rollout_s)  # the engines run through every window
    assert result["rollout_bubble_ratio"] == pytest.approx(1 - busy / windows)
    assert result["rollout_bubble_ratio"] < result["bubble_ratio"] - 0.1


def test_the_simulator_closes_each_rollout_window_at_the_last_sample_generated_before_the_handover():
    """As the live run's `timing/rollout_s` does: an async batch complete while the trainer is still busy waits for
    it, and that wait is neither rollout time nor bubble."""
    from rlsys.sim.config import load_sim_config
    from rlsys.sim.simulator import Simulation

    cfg = load_sim_config({"model": "qwen2.5-7b", "steps": 6, "schedulers": ["async"],
                           "cluster": {"gpu": "h100", "gpus": 4, "trainer_gpus": 2},
                           "workload": {"max_tokens": 2048, "dataset_size": 512},
                           "control": {"prompts_per_step": 8, "group_size": 4, "staleness": {"eta": 2}}})
    sim = Simulation(cfg, cfg.runs()[0])
    windows, train = [], sim._train

    def recording_train(action, touched):
        windows.append((sim.step_start, sim.last_finish, sim.now))
        train(action, touched)
    sim._train = recording_train
    sim.run()
    assert sim.rollout_s == [pytest.approx(max(0.0, last - start)) for start, last, _ in windows]
    assert any(handover - max(start, last) > 1.0 for start, last, handover in windows)  # a wait it leaves out


def test_a_step_logs_its_length_shape_and_the_share_cut_at_the_cap(clock):
    engine = Engine(clock)
    stats = StepStats(kappa=2.0, capacity=2, engine_stats=engine.stats)
    runs = [done(f"r{i}", 100, 101, tokens=n, reason="length" if n == 40 else "stop")
            for i, n in enumerate([2, 4, 4, 6, 8, 10, 12, 20, 40, 40])]
    for c in runs:
        stats.add_completion(c)
    clock.t = 101
    metrics = stats.close_rollout(group(*runs))
    assert metrics["response_length/at_cap"] == pytest.approx(0.2)  # two of ten cut at the cap
    assert metrics["response_length/p50"] <= metrics["response_length/p90"] <= metrics["response_length/p99"] == 40
    assert metrics["response_length/p50"] == pytest.approx(9) and metrics["response_length/p90"] >= 20  # 8 and 10
