"""Per-step rollout windows: sync restarts the window after training, overlapped schedulers carry it on."""
import pytest

from rlsys import step_stats
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


def test_aborted_extras_after_the_handover_do_not_stretch_the_next_window(clock):
    stats = StepStats(kappa=2.0, capacity=2)
    a, b = done("a", 100, 101), done("b", 100, 102)
    stats.add_completion(a), stats.add_completion(b)
    clock.t = 102
    stats.rollout_done(group(a, b), saturated_tokens_per_s=10.0)
    stats.add_completion(done("x", 100, 102.1, reason="abort"))  # tail's extra, cut at the handover
    clock.t = 105  # training took 3 s
    assert stats.step_totals()["timing/step_s"] == pytest.approx(5.0)
    stats.start_step()
    assert stats.t_start == 105  # sync and tail: the engines sat idle while the trainer ran


def test_overlapped_generation_carries_the_window_and_counts_training_once(clock):
    stats = StepStats(kappa=2.0, capacity=1)
    a = done("a", 100, 102)
    stats.add_completion(a)
    clock.t = 102
    stats.rollout_done(group(a), saturated_tokens_per_s=5.0)
    b = done("b", 102, 104)  # finished while the trainer ran (async, sorted)
    stats.add_completion(b)
    clock.t = 104
    assert stats.step_totals()["timing/step_s"] == pytest.approx(4.0)
    stats.start_step()
    assert stats.t_start == 102
    clock.t = 106
    metrics = stats.rollout_done(group(b), saturated_tokens_per_s=5.0)
    assert metrics["rollout/bubble_ratio"] == pytest.approx(0.0)  # one slot, busy from 102 to 104
    assert metrics["rollout/efficiency"] == pytest.approx(1.0)  # 10 tokens in 2 s at 5 tokens/s
    clock.t = 107
    assert stats.step_totals()["timing/step_s"] == pytest.approx(3.0)  # publish to publish


def test_tokens_within_counts_only_the_share_inside_the_window():
    runs = [done("a", 0, 10, tokens=10), done("b", 5, 6, tokens=4), done("c", 20, 30, tokens=5)]
    assert tokens_within(runs, 5, 10) == pytest.approx(5 + 4)
