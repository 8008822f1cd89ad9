"""The sync scheduler and the rollout metrics, driven by scripted events with a fake clock."""
import random
from types import SimpleNamespace

import pytest

from rlsys.config import ControlConfig
from rlsys.control import SCHEDULERS, build_scheduler
from rlsys.control.actions import Submit, Train
from rlsys.control.events import Aborted, Generated, Scored
from rlsys.control.metrics import bubble_ratio, is_straggler, straggler_rate
from rlsys.control.sizing import FixedGroupSizer
from rlsys.data.cursor import PromptCursor
from rlsys.train import Controller
from rlsys.types import Completion, Prompt, ScoredSample

from helpers import next_step


def prompts(n):
    return [Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(n)]


def sync(n_prompts=40, **control):
    cfg = ControlConfig(**control)
    return SCHEDULERS.get("sync")(cfg, PromptCursor(prompts(n_prompts), seed=1), FixedGroupSizer(cfg))


def finish(request_id, uid, reward, tokens=5, t=0.0):
    c = Completion(request_id, uid, [1], [2] * tokens, [-0.1] * tokens, [0] * tokens, "stop",
                   start_time=t, end_time=t + tokens)
    return ScoredSample(c, reward)


def run_step(sched, actions, reward_of=lambda uid, i: float(i % 2), rng=random.Random(0)):
    """Complete every submitted request in a random order; return the Train action and submits seen."""
    pending = [(rid, a.prompt.uid, i) for a in actions if isinstance(a, Submit)
               for i, rid in enumerate(a.request_ids)]
    trains = []
    while pending:
        rid, uid, i = pending.pop(rng.randrange(len(pending)))
        for act in sched.on_sample(finish(rid, uid, reward_of(uid, i)), 0.0):
            if isinstance(act, Train):
                trains.append(act)
            else:
                pending += [(r, act.prompt.uid, j) for j, r in enumerate(act.request_ids)]
    return trains


def test_sync_trains_once_per_step_on_every_group():
    sched = sync(prompts_per_step=4, group_size=3)
    actions = sched.start(0.0)
    assert [len(a.request_ids) for a in actions] == [3, 3, 3, 3]
    trains = run_step(sched, actions)
    assert len(trains) == 1
    groups = trains[0].groups
    assert len(groups) == 4 and all(len(g.samples) == 3 for g in groups)
    assert {g.prompt.uid for g in groups} == {a.prompt.uid for a in actions}
    sched.ledger.check(sched.in_flight_prompts())
    nxt = next_step(sched, 1, groups, 1.0)
    assert len(nxt) == 4 and sched.version == 1


def test_sync_waits_for_the_last_sample():
    sched = sync(prompts_per_step=2, group_size=2)
    a, b = sched.start(0.0)
    assert sched.on_sample(finish(a.request_ids[0], a.prompt.uid, 1), 0) == []
    assert sched.on_sample(finish(a.request_ids[1], a.prompt.uid, 0), 0) == []
    assert sched.on_sample(finish(b.request_ids[0], b.prompt.uid, 0), 0) == []
    out = sched.on_sample(finish(b.request_ids[1], b.prompt.uid, 1), 0)
    assert len(out) == 1 and isinstance(out[0], Train)


def test_unknown_request_is_ignored():
    sched = sync(prompts_per_step=1, group_size=2)
    sched.start(0.0)
    assert sched.on_sample(finish("someone-else#9", "train-0", 1.0), 0) == []


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    sched = sync(prompts_per_step=4, group_size=2,
                 dynamic_sampling={"enabled": True, "max_extra_rounds": 3})
    # Prompts with an even index always get reward 1 (uninformative); odd ones get 0 and 1.
    reward = lambda uid, i: 1.0 if int(uid.split("-")[1]) % 2 == 0 else float(i % 2)  # noqa: E731
    trains = run_step(sched, sched.start(0.0), reward)
    assert len(trains) == 1
    groups = trains[0].groups
    assert all(len(set(g.rewards)) > 1 for g in groups)
    assert sched.ledger.dropped["zero_variance"] > 0
    sched.ledger.check(sched.in_flight_prompts())
    assert sched.ledger.trained == len(groups)


def test_dynamic_sampling_gives_up_after_the_cap():
    sched = sync(prompts_per_step=2, group_size=2, dynamic_sampling={"enabled": True, "max_extra_rounds": 1})
    actions, rounds = sched.start(0.0), 0
    while rounds < 3:  # the first round, the one extra round, then the next step starts afresh
        rounds += 1
        out = []
        for a in actions:
            for rid in a.request_ids:
                out += sched.on_sample(finish(rid, a.prompt.uid, 0.0), 0)  # never informative
        assert not any(isinstance(x, Train) for x in out)
        actions = out
        sched.ledger.check(sched.in_flight_prompts())
    assert sched.ledger.dropped["zero_variance"] == 6  # 2 + 2 in step one, 2 in the next step's first round
    assert len(actions) == 2 and sched.extra_rounds == 1  # step two is on its extra round


def test_state_round_trip_continues_the_same_data_order():
    a = sync(prompts_per_step=3, group_size=2)
    (train,) = run_step(a, a.start(0.0))
    a.on_trained(1, train.groups)
    state = a.state_dict()
    b = sync(prompts_per_step=3, group_size=2)
    b.load_state_dict(state)
    assert [x.prompt.uid for x in a.start(0)] == [x.prompt.uid for x in b.start(0)]


def test_cursor_reshuffles_each_epoch_and_resumes():
    cur = PromptCursor(prompts(5), seed=3)
    first = [p.uid for p in cur.take(5)]
    second = [p.uid for p in cur.take(5)]
    assert sorted(first) == sorted(second) and first != second
    state = cur.state_dict()
    again = PromptCursor(prompts(5), seed=3)
    again.load_state_dict(state)
    assert [p.uid for p in cur.take(7)] == [p.uid for p in again.take(7)]
    with pytest.raises(ValueError, match="empty"):
        PromptCursor([])


def test_straggler_definition():
    assert not is_straggler([10, 10, 10, 20], kappa=2.0)
    assert is_straggler([10, 10, 10, 21], kappa=2.0)
    assert straggler_rate([[1, 1, 1], [1, 1, 9]], kappa=2.0) == 0.5


def test_bubble_ratio_counts_idle_slots_over_the_window():
    busy = [Completion("a", "p", [], [1], [0.0], [0], "stop", start_time=0, end_time=10),
            Completion("b", "p", [], [1], [0.0], [0], "stop", start_time=0, end_time=2)]
    assert bubble_ratio(busy, capacity=2, start=0, end=10) == pytest.approx(1 - 12 / 20)
    assert bubble_ratio(busy, capacity=1, start=0, end=10) == 0.0  # over-full clips at zero
    assert bubble_ratio([], capacity=4, start=0, end=1) == 1.0


def test_build_scheduler_rejects_unknown_names():
    from rlsys.config import Config
    cfg = Config()
    cfg.control.scheduler = "nope"
    with pytest.raises(KeyError, match="unknown scheduler 'nope'"):
        build_scheduler(cfg, PromptCursor(prompts(2)))


def test_on_trained_closes_the_step_the_sizer_observes_and_the_ledger_must_balance():
    cfg = ControlConfig(prompts_per_step=2, group_size=2, group_sizer="sagc", sagc={"sizes": [2, 4]})
    sched = build_scheduler(SimpleNamespace(control=cfg), PromptCursor(prompts(10), seed=1))
    (train,) = run_step(sched, sched.start(0.0))
    sched.on_trained(1, train.groups)
    assert sched.version == 1 and sched.sizer.steps == 1
    assert sched.metrics()["sagc/straggler_rate"] == sched.sizer.metrics()["sagc/straggler_rate"]
    sched.ledger.draw(1)  # a prompt drawn and never accounted for
    with pytest.raises(AssertionError, match="prompt accounting broken"):
        sched.on_trained(2, [])


def test_the_controller_refuses_an_action_it_does_not_know():
    controller = SimpleNamespace(cfg=SimpleNamespace(control=SimpleNamespace(scheduler="mine")))
    with pytest.raises(TypeError, match="scheduler 'mine' asked for an unknown action"):
        Controller.apply(controller, ["train now"])


def test_handle_takes_the_pumps_scored_and_aborted_events_and_refuses_the_rest():
    sched = sync(prompts_per_step=2, group_size=2)
    a, b = sched.start(0.0)
    assert sched.handle(Scored(finish(a.request_ids[0], a.prompt.uid, 1.0)), 0) == []
    assert sched.handle(Aborted(finish(b.request_ids[0], b.prompt.uid, 0.0).completion), 0) == []
    assert b.request_ids[0] not in sched.prompt_of  # on_abort forgot it
    with pytest.raises(TypeError, match="handles Scored and Aborted events"):
        sched.handle(Generated(finish(a.request_ids[1], a.prompt.uid, 0.0).completion), 0)
