"""The `async` scheduler (bounded staleness), driven by scripted events and a fake engine and trainer."""
import json
import random
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from rlsys.config import ControlConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.control.actions import Submit, Train
from rlsys.data.cursor import PromptCursor
from rlsys.sim.run import simulate
from rlsys.types import Completion, Prompt, ScoredSample
from helpers import next_step
from test_sorted import FakeTrainer


def prompts(n):
    return [Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(n)]


def build(name="async", eta=1, n_prompts=5000, **control):
    cfg = ControlConfig(scheduler=name, staleness={"eta": eta}, **control)
    return SCHEDULERS.get(name)(cfg, PromptCursor(prompts(n_prompts), seed=1), GROUP_SIZERS.get("fixed")(cfg))


def sample(rid, uid, versions=(0, 0), reward=1.0):
    versions = list(versions)
    n = len(versions)
    return ScoredSample(Completion(rid, uid, [1], [7] * n, [-0.5] * n, versions, "stop"), reward)


def draw(seed, key):
    """A reproducible random draw per request or per Train, the same whichever scheduler asks."""
    return random.Random(zlib.crc32(f"{seed}/{key}".encode()))


class FakeCluster(FakeTrainer):
    """An unbounded engine and a one-actor trainer on a fake clock. A request takes a heavy-tailed
    time; each of its tokens is stamped with the version loaded when it was generated. A Train takes
    a random time."""

    def __init__(self, sched, seed=0, reward_p=0.5, slow_trainer=3.0):
        super().__init__(sched)
        self.seed, self.reward_p, self.slow_trainer = seed, reward_p, slow_trainer
        self.live: dict[str, tuple[Prompt, float]] = {}  # request id -> (prompt, start time)
        self.admitted_at: dict[str, int] = {}  # request id -> version when its prompt was admitted
        self.submits: list[Submit] = []
        self.overlapped = 0  # samples finished while the trainer was busy

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                self.submits.append(a)
                for rid in a.request_ids:
                    assert rid not in self.live and rid not in self.admitted_at, f"request id {rid} reused"
                    self.live[rid], self.admitted_at[rid] = (a.prompt, self.now), self.version
                    self.push(1 + 4 * draw(self.seed, rid).paretovariate(1.3), "done", rid)
            else:
                assert isinstance(a, Train)
                self.train(a.groups, draw(self.seed, f"train{len(self.trains) + 1}").uniform(0.1, self.slow_trainer))

    def finish(self, rid):
        prompt, start = self.live.pop(rid)
        tokens = max(1, int(self.now - start))
        step = (self.now - start) / tokens
        versions = [self.version_at(start + k * step) for k in range(tokens)]
        reward = float(draw(self.seed, f"r{rid}").random() < self.reward_p)
        completion = Completion(rid, prompt.uid, [1], [7] * tokens, [-0.5] * tokens, versions, "stop")
        return ScoredSample(completion, reward)

    def event(self, kind, payload):  # "done"
        if payload in self.live:
            self.overlapped += self.training
            self.apply(self.sched.on_sample(self.finish(payload), self.now))


def trained_uids(cluster):
    return [[g.prompt.uid for g in groups] for _, groups in cluster.trains]


# --- the admission rule and the deadline, by hand ----------------------------------------------
def finish_group(sched, action, now, versions=(0, 0)):
    """Every sample of the action's group finishes at `now`: what the scheduler does on the last one (nothing
    on the others: the group is not whole before)."""
    *first, last = action.request_ids
    for rid in first:
        assert sched.on_sample(sample(rid, action.prompt.uid, versions), now) == []
    return sched.on_sample(sample(last, action.prompt.uid, versions), now)


def test_admits_while_trained_plus_in_flight_fits_version_plus_eta_batches():
    sched = build(eta=1, prompts_per_step=2, group_size=2)
    subs = sched.start(0.0)
    assert len(subs) == 4 and all(len(a.request_ids) == 2 for a in subs)  # (0 + 1 + 1) x 2
    assert finish_group(sched, subs[2], 1) == []
    (train,) = finish_group(sched, subs[0], 2)
    assert [g.prompt for g in train.groups] == [subs[2].prompt, subs[0].prompt]  # finish order
    assert finish_group(sched, subs[1], 3) == []  # training
    more = next_step(sched, 1, train.groups, 4)
    assert len(more) == 2 and all(isinstance(a, Submit) for a in more)  # 3 x 2 - 2 trained - 2 in flight
    sched.ledger.check(sched.in_flight_prompts())


def test_eta_zero_admits_nothing_while_training():
    sched = build(eta=0, prompts_per_step=2, group_size=2)
    a, b = sched.start(0.0)
    for rid in a.request_ids[:1] + b.request_ids:
        assert sched.on_sample(sample(rid, "x"), 1) == []
    (train,) = sched.on_sample(sample(a.request_ids[1], "x"), 2)
    assert len(train.groups) == 2 and sched.in_flight_prompts() == 0
    assert len(next_step(sched, 1, train.groups, 3)) == 2


def test_a_train_waits_for_a_group_that_would_miss_its_deadline():
    # eta 2, B 1: p1..p3 admitted at v0 are due by v2. If Train 1 took p4 (admitted at v1), p2 and
    # p3 would both be due at Train 2, which holds one group: so Train 1 waits for one of them.
    sched = build(eta=2, prompts_per_step=1, group_size=2)
    p1, p2, p3 = sched.start(0.0)
    (train,) = finish_group(sched, p1, 1)
    (p4,) = next_step(sched, 1, train.groups, 2)
    assert finish_group(sched, p4, 3, versions=[1, 1]) == []
    assert sched.metrics()["async/deadline_waits"] == 1
    (train,) = finish_group(sched, p2, 4, versions=[0, 1])
    assert [g.prompt for g in train.groups] == [p2.prompt]
    next_step(sched, 2, train.groups, 5)
    m = sched.metrics()
    assert m["staleness/max"] == 1 and m["staleness/mean"] == 0.5 and m["async/buffered_groups"] == 1


def test_dropped_groups_free_their_place_and_engine_aborts_are_regenerated():
    sched = build(eta=0, prompts_per_step=2, group_size=2, dynamic_sampling={"enabled": True})
    a, b = sched.start(0.0)
    sched.on_sample(sample(a.request_ids[0], "x", reward=1.0), 1)
    (c,) = sched.on_sample(sample(a.request_ids[1], "x", reward=1.0), 1)  # zero variance: refill at once
    assert isinstance(c, Submit) and sched.metrics()["prompts/dropped_zero_variance"] == 1
    (again,) = sched.on_abort(Completion(b.request_ids[0], "x", [1], [7], [-0.5], [0], "abort"), 2)
    assert again.prompt == b.prompt and len(again.request_ids) == 1
    assert sched.on_abort(Completion(b.request_ids[0], "x", [1], [], [], [], "abort"), 2) == []  # once
    sched.on_sample(sample(b.request_ids[1], "x", reward=0.0), 3)
    sched.on_sample(sample(again.request_ids[0], "x", reward=1.0), 3)
    sched.on_sample(sample(c.request_ids[0], "x", reward=0.0), 3)
    (train,) = sched.on_sample(sample(c.request_ids[1], "x", reward=1.0), 3)
    assert [g.prompt for g in train.groups] == [b.prompt, c.prompt] and sched.metrics()["async/engine_aborts"] == 1
    sched.ledger.check(sched.in_flight_prompts())


# --- properties, with random lengths and train times ----------------------------------------------
@settings(max_examples=40, deadline=None)
@given(eta=st.integers(0, 3), batch=st.integers(1, 4), group=st.integers(2, 4), seed=st.integers(0, 10**6),
       dynamic=st.booleans(), slow_trainer=st.sampled_from([0.2, 3.0, 30.0]))
def test_staleness_is_bounded_and_every_prompt_is_trained_once(eta, batch, group, seed, dynamic, slow_trainer):
    sched = build(eta=eta, prompts_per_step=batch, group_size=group, dynamic_sampling={"enabled": dynamic})
    cluster = FakeCluster(sched, seed, slow_trainer=slow_trainer)
    cluster.apply(sched.start(0.0))
    cluster.run(12)
    seen = set()
    for version, groups in cluster.trains:
        assert len(groups) == batch
        for g in groups:
            rids = [s.completion.request_id for s in g.samples]
            assert len(g.samples) == group and not seen & set(rids)
            seen.update(rids)
            for rid in rids:  # admitted at v, trained at v + eta at the latest, never earlier than v
                assert cluster.admitted_at[rid] <= version <= cluster.admitted_at[rid] + eta
            for s in g.samples:
                assert version - min(s.completion.versions) <= eta
    uids = [u for step in trained_uids(cluster) for u in step]
    assert len(uids) == len(set(uids)) == sched.ledger.trained == len(cluster.trains) * batch
    sched.ledger.check(sched.in_flight_prompts())
    m = sched.metrics()
    assert m["staleness/max"] <= eta and m["prompts/drawn"] == len(cluster.submits)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), group=st.integers(2, 4), seed=st.integers(0, 10**6))
def test_eta_zero_is_the_sync_schedule(batch, group, seed):
    runs = {}
    for name in ("sync", "async"):
        cluster = FakeCluster(build(name, eta=0, prompts_per_step=batch, group_size=group), seed)
        cluster.apply(cluster.sched.start(0.0))
        cluster.run(8)
        runs[name] = [(v, [[s.completion.request_id for s in g.samples] for g in groups])
                      for v, groups in cluster.trains]
    assert runs["async"] == runs["sync"]


def test_generation_goes_on_while_training_and_staleness_is_reported():
    sched = build(eta=2, prompts_per_step=4, group_size=2)
    cluster = FakeCluster(sched, seed=3, slow_trainer=20.0)
    cluster.apply(sched.start(0.0))
    cluster.run(10)
    assert cluster.overlapped and 0 < sched.metrics()["staleness/mean"] <= sched.metrics()["staleness/max"] <= 2


def test_state_round_trip_trains_every_open_prompt_once():
    sched = build(eta=2, prompts_per_step=3, group_size=2)
    cluster = FakeCluster(sched, seed=5)
    saved = {}

    def checkpoint():
        if cluster.version == 4:
            saved["state"] = json.loads(json.dumps(sched.state_dict()))
            saved["trained"] = [u for step in trained_uids(cluster) for u in step]
    cluster.on_update = checkpoint
    cluster.apply(sched.start(0.0))
    cluster.run(4)
    restored = build(eta=2, prompts_per_step=3, group_size=2)
    restored.load_state_dict(saved["state"])
    assert restored.state_dict() == saved["state"]
    restored.ledger.check(restored.in_flight_prompts())
    open_uids = {p["uid"] for p in saved["state"]["async"]["open"]}
    again = FakeCluster(restored, seed=6)
    again.version, again.admitted_at = 4, {}
    again.weight_times = [0.0] * 4
    again.apply(restored.start(0.0))
    assert {a.prompt.uid for a in again.submits[:len(open_uids)]} == open_uids
    again.run(6)
    later = [u for step in trained_uids(again) for u in step]
    assert open_uids <= set(later) and not set(saved["trained"]) & set(later)
    assert len(later) == len(set(later)) and restored.ledger.trained == len(saved["trained"]) + len(later)
    restored.ledger.check(restored.in_flight_prompts())
    assert all(v - min(s.completion.versions) <= 2 for v, gs in again.trains for g in gs for s in g.samples)


def test_the_simulator_runs_it_with_the_bound_and_the_schedule_of_sync_at_eta_zero():
    """On trainer GPUs of its own, generation goes on while training (the simulator needs no change)."""
    runs = ["sync", {"name": "async", "label": "eta0", "control": {"staleness": {"eta": 0}}},
            {"name": "async", "label": "eta2", "control": {"staleness": {"eta": 2}},
             "cluster": {"trainer_gpus": 2}}]
    report = simulate({"name": "small", "steps": 4, "model": "qwen2.5-1.5b", "cluster": {"gpus": 4, "tp": 1},
                       "workload": {"max_tokens": 4096, "median_tokens": 600}, "schedulers": runs,
                       "control": {"prompts_per_step": 8, "group_size": 4}}, quiet=True)["results"]
    assert report["eta0"]["step_ends_s"] == report["sync"]["step_ends_s"]
    assert report["eta0"]["prompts"]["staleness/max"] == 0
    eta2 = report["eta2"]["prompts"]
    assert 0 < eta2["staleness/mean"] and eta2["staleness/max"] <= 2 and report["eta2"]["trained_prompts"] == 4 * 8
