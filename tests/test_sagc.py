"""The `sagc` group sizer on scripted lengths and rewards, alone and driving the sync and tail schedulers."""
import json
import random
import zlib
from collections import defaultdict

import pytest

from rlsys.config import ControlConfig
from rlsys.control.metrics import straggler_rate
from rlsys.control.sagc import SAGCSizer
from rlsys.types import Completion, Group, Prompt, ScoredSample
from test_tail import FakeEngine, build, run

PROMPT = Prompt("train-0", "q", "a")


def sizer(**sagc):
    return SAGCSizer(ControlConfig(group_sizer="sagc", prompts_per_step=16, group_size=8, sagc=sagc))


def straggly(rng, q):
    """Length 10..14, or 40 (over 2x any median) with probability q, so p(G) = 1 - (1 - q)^G rises with G."""
    u = rng.random()
    return 40 if u < q else 10 + int(5 * (u - q) / (1 - q))


def groups(rng, shape, q=0.02, success=0.5):
    def one(n, reward):
        return ScoredSample(Completion("r", PROMPT.uid, [], [0] * n, [], [], "stop"), reward)
    return [Group(PROMPT, [one(straggly(rng, q), float(rng.random() < success)) for _ in range(shape.group_size)])
            for _ in range(shape.prompts)]


def drive(s, steps, seed=0, **kw):
    """Feed `steps` scripted steps of the shape `s` asks for; returns realised rates and sizes per step."""
    rng, rates, sizes = random.Random(seed), [], []
    for _ in range(steps):
        shape = s.next_shape()
        s.observe(groups(rng, shape, **kw))
        rates.append(s.last_rate)
        sizes.append(shape.group_size)
    return rates, sizes


def test_straggler_rate_converges_under_the_budget_when_risk_rises_with_g():
    s = sizer(delta=0.1)
    rates, sizes = drive(s, 800)
    # Per-sample tail 2%: p(4) ~ 0.08 < delta < p(8) ~ 0.15, so the controller must mix 4 and 8.
    # Drift-plus-penalty bounds the overshoot by Q_T / T (about 1.7 / 800 here); 0.01 leaves room.
    assert sum(rates) / len(rates) <= 0.1 + 0.01
    assert sum(rates[-400:]) / 400 <= 0.1 + 0.01
    assert sum(rates[-400:]) / 400 >= 0.1 - 0.02  # and it spends the budget: not stuck at G = 4
    # The first step keeps to the budget already: from the prior, p(8) and p(16) exceed it
    assert {4, 8} <= set(sizes[-400:]) and sizes[0] == 4
    assert sum(rates[:20]) / 20 <= 0.1 + 0.02  # and so does a short run, not only the long-run average
    m = s.metrics()
    assert set(m) >= {"sagc/queue", "sagc/risk", "group_size"} and m["sagc/queue"] == s.queue
    # With independent samples the risk model is calibrated: p(G) matches the realised rate at G.
    by_size = defaultdict(list)
    for rate, g in zip(rates, sizes):
        by_size[g].append(rate)
    for g in (4, 8):
        assert abs(sum(by_size[g]) / len(by_size[g]) - s.risk(g)) < 0.02
    assert abs(s.tail_share() - 0.02) < 0.005


def test_calibration_scales_the_model_to_stragglers_that_come_in_pairs():
    """Samples of a group are not independent (they share a median, a prompt): here a group straggles with two
    long samples at once, so the independence model counts twice the tail and overstates p(G)."""
    s, rng, rates = sizer(sizes=[8]), random.Random(5), []
    for _ in range(300):
        shape, step = s.next_shape(), []
        for _ in range(shape.prompts):
            lengths = [10 + rng.randrange(5) for _ in range(shape.group_size)]
            if rng.random() < 0.1:
                lengths[:2] = [40, 40]
            step.append(Group(PROMPT, [ScoredSample(Completion("r", PROMPT.uid, [], [0] * n, [], [], "stop"), 1.0)
                                       for n in lengths]))
        s.observe(step)
        rates.append(s.last_rate)
    realised = sum(rates[-200:]) / 200
    assert s.model_risk(8) > 1.5 * realised  # the raw model is off ...
    assert abs(s.risk(8) - realised) < 0.02 and s.calibration() < 0.7  # ... the calibrated risk is not


def test_a_workload_change_restarts_the_spread_so_the_sizer_is_careful_before_paying():
    told, untold = sizer(delta=0.02), sizer(delta=0.02)
    for s in (told, untold):
        drive(s, 40, q=0.0)  # calm lengths: the largest size costs nothing
        assert s.next_shape().group_size == 16
    told.workload_changed()  # e.g. the cap on answers rises: the spread seen so far says nothing of the new one
    assert told.next_shape().group_size < 16  # decided before a single step of the new lengths
    told_rates, told_sizes = drive(told, 10, seed=3, q=0.05)
    untold_rates, untold_sizes = drive(untold, 10, seed=3, q=0.05)
    assert untold_sizes[0] == 16 and told_rates[0] < 0.7 * untold_rates[0]  # the untold one pays first ...
    assert sum(told_rates) < sum(untold_rates)  # ... and is not ahead after


def test_realised_rate_is_the_shared_straggler_definition():
    s, rng = sizer(), random.Random(4)
    for _ in range(20):
        step = groups(rng, s.next_shape(), q=0.1)
        s.observe(step)
        assert s.last_rate == straggler_rate([g.lengths for g in step], kappa=2.0)


def test_flat_risk_keeps_the_largest_group():
    for utility in ("informative", "log"):
        s = sizer(utility=utility)
        rates, sizes = drive(s, 100, q=0.0)
        # The prior's risk at 16 (0.28) fits the default budget, and the evidence (no straggler) keeps it there
        assert set(sizes) == {16} and s.queue == -s.sagc.delta and not any(rates)
        assert s.next_shape().prompts == 8  # constant samples: 16 x 8 = 8 x 16


def test_an_unreachable_budget_settles_on_the_smallest_group():
    s = sizer(delta=0.0)
    _, sizes = drive(s, 60)
    assert sizes[-20:] == [4] * 20 and s.next_shape().prompts == 32


def test_constant_prompts_rule_and_config_checks():
    s = sizer(prompt_rule="constant_prompts", delta=0.0)
    drive(s, 30)
    assert s.next_shape().prompts == 16 and s.next_shape().group_size == 4
    for bad in ([], [1, 4], [4, 4]):
        with pytest.raises(ValueError, match="sagc.sizes"):
            ControlConfig(sagc={"sizes": bad})
    # async trains B prompts per update whatever G is, so constant_samples would be silently broken
    with pytest.raises(ValueError, match="sagc.prompt_rule"):
        ControlConfig(scheduler="async", group_sizer="sagc")
    ControlConfig(scheduler="async", group_sizer="sagc", sagc={"prompt_rule": "constant_prompts"})


def test_deterministic_for_a_given_history_and_decided_only_at_step_boundaries():
    a, b = sizer(), sizer()
    assert drive(a, 200, seed=7) == drive(b, 200, seed=7)
    assert a.state_dict() == b.state_dict()
    assert a.next_shape() is a.next_shape()  # reading the shape decides nothing


def test_state_round_trip_continues_identically():
    a = sizer()
    drive(a, 150, seed=1)
    b = sizer()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.next_shape() == a.next_shape() and b.metrics() == a.metrics()
    assert drive(a, 100, seed=2) == drive(b, 100, seed=2)
    assert a.state_dict() == b.state_dict()


def straggly_request(prompt, rid):
    return straggly(random.Random(zlib.crc32(rid.encode())), q=0.03)


@pytest.mark.parametrize("scheduler", ["sync", "tail"])
def test_composes_with_schedulers_groups_have_the_size_chosen_for_their_step(scheduler):
    sched = build(scheduler, "sagc", prompts_per_step=8, group_size=8, sagc={"delta": 0.05})
    engine = FakeEngine(sched, length=straggly_request)
    sizes = []

    def check(step, trained):
        shape = sched.shape  # the shape read at this step's start
        assert sched.sizer.next_shape() == shape, "the shape changed inside a step"
        assert len(trained) == shape.prompts and {len(g.samples) for g in trained} == {shape.group_size}
        sizes.append(shape.group_size)

    run(sched, engine, 60, check)
    assert sizes[0] == 4  # the prior's risk fits no larger size into the budget
    # The sizer did act, so shapes really changed between steps (under tail, FakeEngine also checks that each
    # round's Accumulates announce its own Train's group count).
    assert len(set(sizes)) > 1
    assert sched.sizer.steps == 60


def test_the_default_budget_moves_up_when_lengths_calm_and_down_when_the_tail_share_rises():
    s = sizer()  # delta 0.5
    phases = [(0.0, 60), (0.12, 150), (0.0, 120)]  # calm; a tail where G 4 meets the budget and G 8 does not; calm
    sizes = []
    for seed, (q, steps) in enumerate(phases):
        sizes.append(drive(s, steps, seed=seed, q=q)[1])
    calm, tail, calm_again = sizes
    assert set(calm[-20:]) == {16}
    # down: 16 straggles at 0.87, 8 at 0.64, 4 at 0.40; 16 comes back only now and then, on credit saved at 4
    assert sum(tail[-100:]) / 100 < 8 and tail[-100:].count(16) <= 10 and tail[-100:].count(4) >= 30
    assert set(calm_again[-20:]) == {16}  # and up again once the tail is gone


def test_on_a_cot_sum_like_spread_the_realised_rate_keeps_to_the_default_budget_and_is_reported_per_size():
    # A per-sample tail of 0.13, as cot_sum's emulated runs straggled (G 4: 0.43, G 8: 0.67 under kappa 2)
    s = sizer()
    rates, sizes = drive(s, 800, q=0.13)
    assert sum(rates) / len(rates) <= 0.5 + 0.01 and sum(rates[-400:]) / 400 >= 0.5 - 0.05  # spends it, too
    assert {4, 8} <= set(sizes[-400:])
    m = s.metrics()
    for g in (4, 8):
        assert m[f"sagc/share_g{g}"] == sizes.count(g) / len(sizes)
        at_g = [r for r, size in zip(rates, sizes) if size == g]
        assert m[f"sagc/straggler_rate_g{g}"] == pytest.approx(sum(at_g) / len(at_g))  # steps of g have equal groups
    assert m["sagc/straggler_rate_g4"] < 0.5 < m["sagc/straggler_rate_g8"]
    assert sum(v for k, v in m.items() if k.startswith("sagc/share_g")) == pytest.approx(1.0)
