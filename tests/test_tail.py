"""The `tail` scheduler (RollPacker tail batching), driven by scripted events on a fake clock."""
import heapq
import json
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsys.config import ControlConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.tail import Deferred, ceil_product
from rlsys.data.cursor import PromptCursor
from rlsys.types import Completion, Prompt, ScoredSample

from helpers import next_step


def prompts(n):
    return [Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(n)]


def build(scheduler="tail", sizer="fixed", n_prompts=5000, **control):
    cfg = ControlConfig(scheduler=scheduler, group_sizer=sizer, **control)
    return SCHEDULERS.get(scheduler)(cfg, PromptCursor(prompts(n_prompts), seed=1), GROUP_SIZERS.get(sizer)(cfg))


def completion(rid, uid, tokens, reason="stop", t=0.0, version=0):
    return Completion(rid, uid, [1], [2] * tokens, [-0.1] * tokens, [version] * tokens, reason, end_time=t)


def sample(rid, uid, tokens=5, reward=1.0):
    return ScoredSample(completion(rid, uid, tokens), reward)


def heavy_tailed(prompt, rid):
    """A per-prompt scale (every 7th prompt is long) times a Pareto draw, fixed by the request id."""
    rng = random.Random(zlib.crc32(rid.encode()))
    scale = 6.0 if prompt.index % 7 == 0 else 1.0
    return min(int(10 * scale * rng.paretovariate(1.5)), 600)


def coin(prompt, rid):
    return float(random.Random(zlib.crc32(rid.encode()) + 1).random() < 0.4)


class FakeEngine:
    """An unbounded engine on a fake clock: a request finishes `length` time units after its submit.

    An aborted request reports its partial output through `on_abort`, except that a share `late` of
    them race the abort and finish anyway, as a real engine's may.
    """

    def __init__(self, sched, length=heavy_tailed, reward=coin, late=0.0, seed=0):
        self.sched, self.length, self.reward, self.late = sched, length, reward, late
        self.rng = random.Random(seed)
        self.now, self.version, self._seq = 0.0, 0, 0
        self.events = []  # (time, seq, kind, rid, prompt, submit time)
        self.live = {}  # rid -> prompt, for requests generating
        self.version_of = {}  # rid -> the policy version it was submitted under
        self.seen, self.aborted = set(), set()
        self.trains, self.submits = [], []  # what the scheduler asked for, in order
        self.accumulated = []  # groups announced for streamed training since the last Train
        self.announced = 0  # the Train's group count they announced

    def push(self, t, kind, rid, prompt, t0):
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, rid, prompt, t0))

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                assert not a.resume, "tail never resumes a request"
                self.submits.append(a)
                for rid in a.request_ids:
                    assert rid not in self.seen, f"request id {rid} reused"
                    self.seen.add(rid)
                    self.live[rid] = a.prompt
                    self.version_of[rid] = self.version
                    self.push(self.now + self.length(a.prompt, rid), "done", rid, a.prompt, self.now)
            elif isinstance(a, Abort):
                for rid in a.request_ids:
                    self.aborted.add(rid)
                    if rid in self.live and self.rng.random() >= self.late:
                        self.push(self.now, "abort", rid, self.live.pop(rid), self.now)
            elif isinstance(a, Accumulate):
                assert not self.accumulated or a.train_groups == self.announced  # one size for the whole round
                assert a.long_round == getattr(self.sched, "long_round", False)  # where a scale-down may come
                self.accumulated += a.groups
                self.announced = a.train_groups
            else:
                assert isinstance(a, Train)
                # tail announces every group it trains, unchanged and in order (sync and sorted announce none),
                # and how many the Train holds: where a streamed trainer cuts its mini-batches
                assert not self.accumulated or (a.groups == self.accumulated and len(a.groups) == self.announced)
                self.trains.append(a.groups)
                self.accumulated = []

    def step(self):
        """Deliver events until the scheduler trains; returns that step's groups."""
        n = len(self.trains)
        while len(self.trains) == n:
            t, _, kind, rid, prompt, t0 = heapq.heappop(self.events)
            self.now = t
            if kind == "abort":
                self.apply(self.sched.on_abort(completion(rid, prompt.uid, 3, "abort", t), t))
            elif self.live.pop(rid, None) is not None:  # includes aborted requests that finish late
                c = completion(rid, prompt.uid, self.length(prompt, rid), t=t, version=self.version_of[rid])
                s = ScoredSample(c, self.reward(prompt, rid))
                self.apply(self.sched.on_sample(s, t))
        return self.trains[-1]

    def trained(self, last=False):
        """The step boundary, as the drivers cross it: after the last step nothing more starts."""
        self.version += 1
        self.sched.on_trained(self.version, self.trains[-1])
        if not last:
            self.apply(self.sched.start(self.now))


def run(sched, engine, steps, check=lambda step, groups: None):
    engine.apply(sched.start(0.0))
    for step in range(steps):
        groups = engine.step()
        sched.ledger.check(sched.in_flight_prompts())
        check(step, groups)
        engine.trained(last=step == steps - 1)


# --- scripted rounds ---------------------------------------------------------------------------
def test_short_round_over_draws_whole_prompts_and_trains_each_with_its_whole_group():
    sched = build(prompts_per_step=4, group_size=4)  # eta_p 1.25: 5 prompts x 4 samples, no extra sample
    subs = sched.start(0.0)
    assert [len(s.request_ids) for s in subs] == [4] * 5 and sched.long_round is False
    a, b, c, d, e = subs
    out = [sched.on_sample(sample(rid, a.prompt.uid), 0) for rid in a.request_ids]
    assert out[:3] == [[], [], []]
    [announce] = out[3]  # a complete prompt is announced for streamed training; nothing of it is aborted
    assert isinstance(announce, Accumulate) and [g.prompt for g in announce.groups] == [a.prompt]
    assert [x.completion.request_id for x in announce.groups[0].samples] == a.request_ids
    assert announce.train_groups == 4 and announce.long_round is False  # no scale-down in a short round
    for s in (b, c):
        for rid in s.request_ids:
            sched.on_sample(sample(rid, s.prompt.uid), 0)
    sched.on_sample(sample(e.request_ids[0], e.prompt.uid), 0)  # e is started, not complete
    for rid in d.request_ids[:3]:
        assert sched.on_sample(sample(rid, d.prompt.uid), 0) == []
    announce, abort, train = sched.on_sample(sample(d.request_ids[3], d.prompt.uid), 0)
    assert announce.groups == train.groups[-1:]
    assert abort == Abort(sorted(e.request_ids[1:]))  # only the unfinished prompt's requests are cut
    assert [g.prompt.uid for g in train.groups] == [s.prompt.uid for s in (a, b, c, d)]
    for g, s in zip(train.groups, (a, b, c, d)):  # every sample the prompt was given, none left out
        assert [x.completion.request_id for x in g.samples] == s.request_ids
    assert list(sched.queue) == [Deferred(e.prompt, 0)]  # deferred under version 0, its finished sample dropped
    sched.ledger.check(sched.in_flight_prompts())
    m = sched.metrics()
    assert m["tail/round"] == 0 and m["tail/long_queue"] == 1 and m["prompts/deferred"] == 1
    assert m["tail/aborted_samples"] == 3 and m["tail/discarded_samples"] == 1 and m["tail/max_wait"] == 0
    assert sched.on_sample(sample(e.request_ids[1], e.prompt.uid), 0) == []  # finished in flight: ignored
    assert sched.on_abort(completion(e.request_ids[2], e.prompt.uid, 7, "abort"), 0) == []
    assert sched.metrics()["tail/wasted_tokens"] == 7


def test_long_round_runs_the_oldest_queued_prompts_fresh():
    sched = build(prompts_per_step=2, group_size=2, tail={"eta_p": 1.5})
    seen = set()
    for _ in range(2):  # two short rounds: 3 prompts drawn, 2 trained, 1 queued each time
        subs = sched.start(0.0)
        seen.update(rid for s in subs for rid in s.request_ids)
        for s in subs[:2]:
            out = [sched.on_sample(sample(rid, s.prompt.uid), 0) for rid in s.request_ids]
        assert isinstance(out[-1][-1], Train)
    queued = [d.prompt for d in sched.queue]
    assert len(queued) == 2
    subs = next_step(sched, 1, [], 0.0)  # the groups trained do not matter to the fixed sizer
    assert sched.long_round and [s.prompt for s in subs] == queued and not sched.queue
    ids = [rid for s in subs for rid in s.request_ids]
    assert [len(s.request_ids) for s in subs] == [2, 2] and not seen & set(ids)
    out = []
    for s in subs:
        for rid in s.request_ids:
            out += sched.on_sample(sample(rid, s.prompt.uid), 0)
    assert [type(a) for a in out] == [Accumulate, Accumulate, Train]  # no speculation: nothing to abort
    assert all(a.long_round for a in out[:2])  # a scale-down may come in this round
    assert {g.prompt.uid for g in out[-1].groups} == {p.uid for p in queued}
    assert sched.metrics()["tail/round"] == 1 and sched.metrics()["tail/max_wait"] == 1  # deferred at 0, run at 1
    sched.ledger.check(sched.in_flight_prompts())


def test_bounded_long_round_submits_as_room_frees_up():
    sched = build(prompts_per_step=4, group_size=2, tail={"eta_p": 1.25, "long_round_samples": 5})
    queued = sched.draw(4)
    sched.queue.extend(Deferred(p, 0) for p in queued)  # as if deferred by short rounds: the next round is long
    pending = list(sched.start(0.0))
    assert sched.long_round and [s.prompt for s in pending] == queued[:2]  # a third group would make 6 > 5
    submitted, live, most, out = list(pending), 4, 4, []
    while pending:
        s = pending.pop(0)
        for rid in s.request_ids:
            actions = sched.on_sample(sample(rid, s.prompt.uid), 0)
            new = [a for a in actions if isinstance(a, Submit)]
            live += sum(len(a.request_ids) for a in new) - 1
            most = max(most, live)
            pending += new
            submitted += new
            out += actions
    assert [s.prompt for s in submitted] == queued and most == 5  # in queue order, never more than 5 at once
    assert isinstance(out[-1], Train) and len(out[-1].groups) == 4
    sched.ledger.check(sched.in_flight_prompts())


def test_engine_side_abort_is_replaced_by_a_fresh_request():
    sched = build(prompts_per_step=1, group_size=2, tail={"eta_p": 1.0})
    (sub,) = sched.start(0.0)
    (again,) = sched.on_abort(completion(sub.request_ids[0], sub.prompt.uid, 4, "abort"), 0)
    assert again.prompt == sub.prompt and len(again.request_ids) == 1
    assert again.request_ids[0] not in sub.request_ids
    sched.on_sample(sample(sub.request_ids[1], sub.prompt.uid), 0)
    _, train = sched.on_sample(sample(again.request_ids[0], sub.prompt.uid), 0)
    assert len(train.groups[0].samples) == 2


def test_config_errors_and_mid_round_checkpoints_are_refused():
    with pytest.raises(ValueError, match="dynamic_sampling"):
        build(dynamic_sampling={"enabled": True})
    with pytest.raises(ValueError):
        ControlConfig(tail={"eta_p": 0.5})
    with pytest.raises(ValueError, match="max_wait_steps"):
        ControlConfig(tail={"max_wait_steps": 0})  # a prompt deferred under version v is run at v + 1 at the soonest
    with pytest.raises(ValueError, match="control.tail.eta_r is gone: .* each prompt is trained with its whole group"):
        ControlConfig(tail={"eta_r": 1.25})
    sched = build(prompts_per_step=2, group_size=2)
    sched.start(0.0)
    with pytest.raises(RuntimeError, match="between rounds"):
        sched.state_dict()


# --- long runs on the fake engine --------------------------------------------------------------
def check_run(p, r, eta_p, steps, late, seed, max_wait=4):
    """Run tail for `steps` steps on heavy-tailed lengths and assert every invariant at each step."""
    sched = build(prompts_per_step=p, group_size=r, tail={"eta_p": eta_p, "max_wait_steps": max_wait})
    engine = FakeEngine(sched, length=lambda prompt, rid: heavy_tailed(prompt, f"{seed}/{rid}"), late=late, seed=seed)
    trained_uids, trained_rids = [], set()
    queue_bound = p - 1 + ceil_product(eta_p, p) - p  # under P at a short round's start, which queues the rest
    queue_max = [0]
    long_rounds, waits, round_submits = [], [], []

    def check(step, groups):
        assert len(groups) == p and all(len(g.samples) == r for g in groups)
        submitted = [(a.prompt, set(a.request_ids)) for a in round_submits]
        for g in groups:
            rids = [s.completion.request_id for s in g.samples]
            assert all(s.completion.prompt_uid == g.prompt.uid for s in g.samples)
            # the group is every request the round gave its prompt, none picked by when it finished ...
            assert (g.prompt, set(rids)) in submitted
            # ... all sampled by the weights the step trains
            assert {v for s in g.samples for v in s.completion.versions} == {engine.version}
            assert not set(rids) & engine.aborted, "an aborted request reached Train"
            assert not set(rids) & trained_rids
            trained_rids.update(rids)
        trained_uids.extend(g.prompt.uid for g in groups)
        queue_max[0] = max(queue_max[0], len(sched.queue))
        if sched.long_round:
            long_rounds.append(step)

    # Long rounds: the queue's oldest prompts, then fresh ones up to P, each with exactly R brand-new requests.
    real_start = sched.start

    def start(now):
        queued, seen = list(sched.queue), set(engine.seen)
        actions = real_start(now)
        round_submits[:] = actions
        if sched.long_round:
            taken = queued[:p]
            waits.extend(sched.version - d.since for d in taken)
            assert [a.prompt for a in actions[:len(taken)]] == [d.prompt for d in taken]
            assert not {a.prompt.uid for a in actions[len(taken):]} & {d.prompt.uid for d in queued}
            assert len(actions) == p
            assert all(len(a.request_ids) == r and not set(a.request_ids) & seen for a in actions)
        return actions
    sched.start = start

    run(sched, engine, steps, check)
    assert len(trained_uids) == len(set(trained_uids)), "a prompt was trained twice"
    drawn = {a.prompt.uid for a in engine.submits}
    assert drawn == set(trained_uids) | {q.prompt.uid for q in sched.queue}
    assert sched.ledger.drawn == len(trained_uids) + len(sched.queue)
    assert queue_max[0] <= queue_bound
    assert max(waits, default=0) <= max_wait and sched.metrics()["tail/max_wait"] == max(waits, default=0)
    return sched, long_rounds


def test_heavy_tails_over_many_steps_keep_the_queue_bounded_and_drain_it():
    sched, long_rounds = check_run(p=8, r=4, eta_p=1.25, steps=80, late=0.3, seed=0)
    # Each short round queues 2 of its 10 prompts, so every fifth round is a long one, whose oldest prompt waited
    # 4 versions: the default max_wait_steps, which thus adds no long round here.
    assert long_rounds == list(range(4, 80, 5))
    m = sched.metrics()
    assert m["tail/long_rounds"] == len(long_rounds) and m["tail/short_rounds"] == 80 - len(long_rounds)
    assert m["tail/aborted_samples"] > 0 and m["tail/wasted_tokens"] > 0 and m["tail/max_wait"] == 4


@pytest.mark.parametrize("max_wait, long_every, waited", [(100, 9, 8), (3, 4, 3), (1, 2, 1)])
def test_a_deferred_prompt_waits_at_most_max_wait_steps(max_wait, long_every, waited):
    """P=8 at eta_p 1.125 defers one prompt a round: the queue holds P only after 8 short rounds, unless the
    oldest prompt's wait calls the long round first, which then tops the queue's prompts up with fresh ones."""
    sched, long_rounds = check_run(p=8, r=2, eta_p=1.125, steps=36, late=0.0, seed=3, max_wait=max_wait)
    assert long_rounds == list(range(long_every - 1, 36, long_every))
    assert sched.metrics()["tail/max_wait"] == waited


@settings(max_examples=25, deadline=None, derandomize=True)
@given(p=st.integers(1, 6), r=st.integers(2, 5), eta_p=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
       max_wait=st.sampled_from([1, 2, 4]), late=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 10**6))
def test_invariants_hold_for_random_completion_orders(p, r, eta_p, max_wait, late, seed):
    check_run(p, r, eta_p, steps=12, late=late, seed=seed, max_wait=max_wait)


def test_the_slowest_sample_of_a_group_is_trained_with_it():
    """The last of each prompt's R requests is its slowest sample and the only one rewarded; every third prompt is
    slow as a whole, so short rounds defer it. Every trained group must hold its one reward: a round that kept the
    first samples of a prompt to finish would train groups of zeros, and learn nothing."""
    p, r = 4, 4
    last = lambda rid: int(rid.rsplit("#", 1)[1]) % r == r - 1  # noqa: E731 (a round's Submits take R ids each)
    length = lambda prompt, rid: (50 if last(rid) else 5 + int(rid.rsplit("#", 1)[1]) % r) * (  # noqa: E731
        8 if prompt.index % 3 == 0 else 1)
    sched = build(prompts_per_step=p, group_size=r, tail={"eta_p": 1.5})
    engine = FakeEngine(sched, length=length, reward=lambda prompt, rid: float(last(rid)))
    trained = []

    def check(step, groups):
        for g in groups:
            [rewarded] = [s for s in g.samples if s.reward == 1.0]
            assert rewarded.completion.num_tokens == max(s.completion.num_tokens for s in g.samples)
            trained.append((g.prompt.index, sched.long_round))
    run(sched, engine, 12, check)
    assert any(long and index % 3 == 0 for index, long in trained)  # slow prompts were deferred, then trained
    assert len(trained) == 12 * p


def test_a_prompt_drawn_twice_in_one_round_is_two_groups():
    sched = build(n_prompts=3, prompts_per_step=2, group_size=2, tail={"eta_p": 2.0})  # 4 draws from 3
    sizes = []
    run(sched, FakeEngine(sched), 20, lambda step, groups: sizes.append([len(g.samples) for g in groups]))
    assert sizes == [[2, 2]] * 20 and sched.ledger.drawn == 2 * 20 + len(sched.queue)


def test_state_round_trip_mid_run_continues_identically():
    """8 prompts a round for P=6 defer 2: with max_wait_steps=2 every third round is a long one, called by the
    wait of a queue that holds 4, so the resumed run goes on identically only if each prompt's wait survives."""
    control = dict(prompts_per_step=6, group_size=3, tail={"max_wait_steps": 2})
    a = build(**control)
    engine_a = FakeEngine(a)
    run(a, engine_a, 4)
    assert [d.since for d in a.queue] == [3, 3], "the test needs a checkpoint with prompts waiting for a long round"
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints are JSON
    b = build(**control)
    b.load_state_dict(state)
    assert list(b.queue) == list(a.queue) and b.metrics() == a.metrics() and b.metrics()["tail/max_wait"] == 2
    engine_b = FakeEngine(b)
    engine_b.version = b.version
    engine_b.apply(b.start(0.0))
    engine_a.apply(a.start(0.0))  # run() crossed a's last step boundary and started nothing after it
    trace = lambda e: [(s.prompt.uid, s.request_ids) for s in e.submits[-len(engine_b.submits):]]  # noqa: E731
    assert trace(engine_a) == trace(engine_b)
    for _ in range(8):
        ga, gb = engine_a.step(), engine_b.step()
        assert [[s.completion.request_id for s in g.samples] for g in ga] == \
               [[s.completion.request_id for s in g.samples] for g in gb]
        assert a.long_round == b.long_round and list(a.queue) == list(b.queue)
        engine_a.trained()
        engine_b.trained()
    assert a.counts["long_rounds"] > state["tail"]["counts"]["long_rounds"]
