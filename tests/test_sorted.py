"""The `sorted` scheduler (SortedRL), driven by scripted events and a fake engine on a fake clock."""
import heapq
import json
import math
import random
import zlib
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsys.config import Config, ControlConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS, build_scheduler
from rlsys.control.actions import Abort, Submit, Train
from rlsys.control.scheduler import version_counts
from rlsys.control.sorted import span
from rlsys.data.cursor import PromptCursor
from rlsys.runs import Runs
from rlsys.types import Completion, Prompt, Request, ScoredSample, ToolTurn

from helpers import next_step


def prompts(n):
    return [Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(n)]


def build(n_prompts=5000, **control):
    cfg = ControlConfig(scheduler="sorted", **control)
    return SCHEDULERS.get("sorted")(cfg, PromptCursor(prompts(n_prompts), seed=1), GROUP_SIZERS.get("fixed")(cfg))


def completion(rid, uid, tokens, reason="stop", versions=None):
    versions = [0] * tokens if versions is None else versions
    return Completion(rid, uid, [1], [7] * tokens, [-0.5] * tokens, versions, reason)


def sample(rid, uid, tokens=4, reward=1.0, versions=None):
    return ScoredSample(completion(rid, uid, tokens, versions=versions), reward)


def heavy_tailed(prompt, lineage, seed=0):
    """Every 5th prompt is long; a Pareto draw per sample lineage."""
    rng = random.Random(zlib.crc32(f"{seed}/{prompt.uid}/{lineage}".encode()))
    scale = 8.0 if prompt.index % 5 == 0 else 1.0
    return max(1, min(int(4 * scale * rng.paretovariate(1.5)), 400))


def coin(prompt, lineage):
    return float(random.Random(zlib.crc32(f"r/{lineage}".encode())).random() < 0.5)


class FakeTrainer:
    """A fake clock, its event queue and a one-actor trainer. A Train's update lands `seconds` later,
    or inside the Train at 0, as with the live controller; its weights load at once and the scheduler
    is told as the live controller tells it. Subclasses play the engine: they `apply` the scheduler's
    actions and handle the events they push (`event`)."""

    def __init__(self, sched):
        self.sched = sched
        self.now, self.version, self._seq = 0.0, 0, 0
        self.weight_times = []  # when versions 1, 2, ... were loaded
        self.events = []
        self.trains = []  # (version trained at, groups) in order
        self.training = False
        self.on_train = lambda version, groups: None  # checks, at each Train
        self.on_update = lambda: None  # e.g. a checkpoint, once the update has landed

    def push(self, dt, kind, payload):
        self._seq += 1
        heapq.heappush(self.events, (self.now + dt, self._seq, kind, payload))

    def version_at(self, t):
        return bisect_right(self.weight_times, t)

    def train(self, groups, seconds):
        assert not self.training, "one Train at a time"
        self.trains.append((self.version, groups))
        self.on_train(self.version, groups)
        self.training = True
        if seconds:
            self.push(seconds, "trained", None)
        else:
            self.trained()

    def trained(self):
        self.version += 1
        self.weight_times.append(self.now)
        self.training = False
        self.sched.on_trained(self.version, self.trains[-1][1])
        self.on_update()
        self.apply(self.sched.start(self.now))

    def run(self, trains):
        """Deliver events until the scheduler has emitted `trains` Trains and seen them applied (an
        `on_trained` may emit one more, which is applied too); the ledger must balance after each."""
        while len(self.trains) < trains or self.training:
            assert self.events, f"stuck after {len(self.trains)} Trains: nothing in flight"
            assert self._seq < 200_000, f"no progress after {len(self.trains)} Trains"
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "trained":
                self.trained()
            else:
                self.event(kind, payload)
            self.sched.ledger.check(self.sched.in_flight_prompts())

    def apply(self, actions):
        raise NotImplementedError

    def event(self, kind, payload):
        raise NotImplementedError


@dataclass
class Live:
    prompt: Prompt
    lineage: int  # the request that started this sample: resumes continue it
    start: float
    resume: Optional[Request]
    target: int  # full length of the sample, resumed tokens included


class FakeEngine(FakeTrainer):
    """An unbounded engine on a fake clock: one token per time unit, each stamped with the policy
    version loaded when it was generated (weights load when the trainer's update lands).

    A sample's length is fixed by its lineage, so a resumed sample ends where it would have. An abort
    stops a request at once; its partial output comes back `abort_delay` later, or, for a share
    `late` of them, the full sample does, as when a request finishes while the abort is on its way.
    The trainer takes `train_s`. A share `engine_aborts` of requests is aborted by the engine itself
    at a random point.
    """

    def __init__(self, sched, length=heavy_tailed, reward=coin, late=0.0, abort_delay=0.0, train_s=0.0,
                 engine_aborts=0.0, seed=0):
        super().__init__(sched)
        self.length, self.reward = length, reward
        self.late, self.abort_delay, self.train_s, self.engine_aborts = late, abort_delay, train_s, engine_aborts
        self.rng = random.Random(seed)
        self.lineages = 0
        self.live: dict[str, Live] = {}
        self.partials: dict[int, Completion] = {}  # lineage -> last partial reported, until resumed
        self.seen, self.aborted = set(), set()
        self.arrived = {}  # request id -> time its sample reached the scheduler
        self.submits, self.resumes = [], []
        self.round_of, self.first_train = {}, {}  # per prompt uid: its round, Trains before its first submit
        self.prompt_of = {}

    def output(self, rid, live, new, reason):
        r = live.resume
        ids, lps, vs = (list(r.resume_ids), list(r.resume_logprobs), list(r.resume_versions)) if r else ([], [], [])
        for k in range(new):
            ids.append(live.lineage)
            lps.append(-(len(ids) + live.lineage % 89) / 1000)
            vs.append(self.version_at(live.start + k))
        return Completion(rid, live.prompt.uid, [1], ids, lps, vs, reason)

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                self._submit(a)
            elif isinstance(a, Abort):
                self._abort(a.request_ids)
            else:
                assert isinstance(a, Train)
                self.train(a.groups, self.train_s)

    def _submit(self, a):
        self.submits.append(a)
        uid = a.prompt.uid
        self.prompt_of[uid] = a.prompt
        if uid not in self.round_of:  # a new round starts only once the last one has left the engine
            assert all(self.round_of[x.prompt.uid] == self.sched.round for x in self.live.values())
            self.round_of[uid], self.first_train[uid] = self.sched.round, len(self.trains)
        for rid in a.request_ids:
            assert rid not in self.seen, f"request id {rid} reused"
            self.seen.add(rid)
            resume, done = a.resume.get(rid), 0
            if resume:
                assert resume.request_id == rid and resume.prompt_uid == uid and resume.prompt_ids == [1]
                partial = self.partials.pop(resume.resume_ids[0])  # resumes only what was reported
                assert (list(resume.resume_ids), list(resume.resume_logprobs), list(resume.resume_versions)) \
                    == (partial.token_ids, partial.logprobs, partial.versions)
                lineage, done = resume.resume_ids[0], len(resume.resume_ids)
                self.resumes.append((rid, partial))
            else:
                self.lineages += 1
                lineage = self.lineages
            live = Live(a.prompt, lineage, self.now, resume, max(self.length(a.prompt, lineage), done + 1))
            self.live[rid] = live
            self.push(live.target - done, "done", rid)
            if self.rng.random() < self.engine_aborts:
                self.push(self.rng.uniform(0, live.target - done), "engine_abort", rid)

    def _abort(self, request_ids):
        for rid in request_ids:
            self.aborted.add(rid)
            live = self.live.pop(rid, None)
            if live is None:
                continue
            left = live.target - (len(live.resume.resume_ids) if live.resume else 0)
            delay = self.rng.uniform(0, self.abort_delay)
            if self.rng.random() < self.late:
                self.push(delay, "late", self.output(rid, live, left, "stop"))
            else:
                partial = self.output(rid, live, min(int(self.now - live.start), left - 1), "abort")
                self.partials[live.lineage] = partial
                self.push(delay, "abort_out", partial)

    def deliver(self, c):
        self.arrived[c.request_id] = self.now
        reward = self.reward(self.prompt_of[c.prompt_uid], c.token_ids[0])
        self.apply(self.sched.on_sample(ScoredSample(c, reward), self.now))

    def event(self, kind, payload):
        if kind == "done" and payload in self.live:
            live = self.live.pop(payload)
            left = live.target - (len(live.resume.resume_ids) if live.resume else 0)
            self.deliver(self.output(payload, live, left, "stop"))
        elif kind == "engine_abort" and payload in self.live:
            live = self.live.pop(payload)
            partial = self.output(payload, live, int(self.now - live.start), "abort")
            self.partials[live.lineage] = partial
            self.apply(self.sched.on_abort(partial, self.now))
        elif kind == "abort_out":
            self.apply(self.sched.on_abort(payload, self.now))
        elif kind == "late":
            self.deliver(payload)


def rids(groups):
    return [[s.completion.request_id for s in g.samples] for g in groups]


# --- scripted runs -----------------------------------------------------------------------------
def test_shorter_groups_train_first_and_the_round_ends_before_the_next():
    sched = build(prompts_per_step=2, group_size=2, sorted={"rollout_prompts": 6})
    engine = FakeEngine(sched, length=lambda prompt, lineage: 10 + prompt.index)
    engine.apply(sched.start(0.0))
    first = [a.prompt for a in engine.submits]
    assert len(first) == 6 and all(len(a.request_ids) == 2 for a in engine.submits)
    engine.run(3)
    trained = [g.prompt for _, groups in engine.trains for g in groups]
    assert trained == sorted(first, key=lambda p: p.index)  # short to long, every prompt once
    assert [len(groups) for _, groups in engine.trains] == [2, 2, 2]
    assert [v for v, _ in engine.trains] == [0, 1, 2]
    assert {engine.round_of[p.uid] for p in first} == {1} and sched.round == 2  # round 2 began after
    assert all(engine.round_of[a.prompt.uid] == 2 for a in engine.submits[-6:])
    m = sched.metrics()
    assert m["sorted/aborted"] == m["sorted/regenerated"] == 4 * 2 + 2 * 2  # at Trains 1 and 2
    assert m["sorted/max_delay_updates"] == 3 and m["sorted/resumed"] == 0
    assert m["staleness/max_versions"] == 1 and m["staleness/mean"] == 0 and m["staleness/max"] == 0
    assert m["sorted/deferred_prompts"] == 6 and m["prompts/trained"] == 6


def test_groups_of_a_train_are_in_finish_order_and_unfinished_ones_aborted():
    sched = build(prompts_per_step=2, group_size=2, sorted={"rollout_prompts": 3})
    a, b, c = sched.start(0.0)
    assert sched.on_sample(sample(b.request_ids[0], b.prompt.uid), 1) == []
    assert sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 2) == []
    assert sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 3) == []  # a completes first
    assert sched.on_sample(sample(c.request_ids[0], c.prompt.uid), 4) == []
    abort, train = sched.on_sample(sample(b.request_ids[1], b.prompt.uid), 5)
    assert [g.prompt for g in train.groups] == [a.prompt, b.prompt]
    assert rids(train.groups) == [a.request_ids, [b.request_ids[0], b.request_ids[1]]]
    assert abort == Abort([c.request_ids[1]])
    sched.ledger.check(sched.in_flight_prompts())
    assert sched.on_sample(sample(c.request_ids[1], c.prompt.uid), 6) == []  # raced the abort: ignored
    (again,) = next_step(sched, 1, train.groups, 7)  # on_policy: c's finished sample is from old weights too
    assert again.prompt == c.prompt and len(again.request_ids) == 2 and not again.resume
    assert not set(again.request_ids) & set(c.request_ids)
    assert sched.on_sample(sample(again.request_ids[0], c.prompt.uid, versions=[1] * 4), 8) == []
    (train,) = sched.on_sample(sample(again.request_ids[1], c.prompt.uid, versions=[1] * 4), 9)
    assert len(train.groups) == 1  # the round's leftovers
    assert sched.metrics()["sorted/regenerated"] == 2 and sched.in_flight_prompts() == 0


def test_on_policy_never_trains_a_token_of_older_weights():
    sched = build(prompts_per_step=3, group_size=4, sorted={"rollout_prompts": 10})
    engine = FakeEngine(sched, late=0.3, abort_delay=5.0, train_s=3.0, seed=2)

    def check(version, groups):
        for g in groups:
            for s in g.samples:
                assert set(s.completion.versions) == {version}
                assert s.completion.request_id not in engine.aborted
    engine.on_train = check
    engine.apply(sched.start(0.0))
    engine.run(12)
    assert sched.metrics()["staleness/max_versions"] == 1 and sched.metrics()["sorted/regenerated"] > 0


def test_partial_resumes_with_the_tokens_logprobs_and_versions_of_the_abort():
    sched = build(prompts_per_step=1, group_size=2, sorted={"rollout_prompts": 2, "mode": "partial"})
    a, b = sched.start(0.0)
    assert sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 1) == []
    abort, train = sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 1)
    assert abort == Abort(b.request_ids)
    assert next_step(sched, 1, train.groups, 2) == []  # b's partial output is not back yet
    resumed = []
    turn = ToolTurn("calculator", True, None, 0.5)
    for old in b.request_ids:  # conversations cut after a tool's answer (token 7): they go on from there
        partial = Completion(old, b.prompt.uid, [1, 2], [5, 6, 7], [-0.1, -0.2, 0.0], [0, 0, 0], "abort",
                             mask=[1, 1, 0], turns=[turn])
        (resubmit,) = sched.on_abort(partial, 3)
        (rid,) = resubmit.request_ids
        assert resubmit.prompt == b.prompt and rid not in b.request_ids
        assert resubmit.resume == {rid: Request(rid, b.prompt.uid, [1, 2], resume_ids=[5, 6, 7],
                                                resume_logprobs=[-0.1, -0.2, 0.0], resume_versions=[0, 0, 0],
                                                resume_mask=[1, 1, 0], resume_turns=[turn])}
        resumed.append(rid)
    done = [sample(rid, b.prompt.uid, tokens=5, versions=[0, 0, 0, 1, 1]) for rid in resumed]
    assert sched.on_sample(done[0], 4) == []
    (train,) = sched.on_sample(done[1], 4)
    assert train.groups[0].samples == done
    m = sched.metrics()
    assert m["sorted/resumed"] == 2 and m["staleness/max_versions"] == 2 and m["staleness/max"] == 1
    assert m["staleness/mean"] == pytest.approx(6 / 18)  # 3 tokens one version old per sample of b, of 2 x 4 + 2 x 5


def test_partial_output_back_before_the_update_waits_for_the_new_weights():
    sched = build(prompts_per_step=1, group_size=2, sorted={"rollout_prompts": 2, "mode": "partial"})
    a, b = sched.start(0.0)
    sched.on_sample(sample(b.request_ids[0], b.prompt.uid), 1)  # b half done
    sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 1)
    abort, train = sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 2)
    assert abort.request_ids == [b.request_ids[1]]
    assert sched.on_abort(completion(b.request_ids[1], b.prompt.uid, 2, "abort"), 3) == []
    (resubmit,) = next_step(sched, 1, train.groups, 4)
    assert len(resubmit.request_ids) == 1 and list(resubmit.resume.values())[0].resume_ids == [7, 7]
    (train,) = sched.on_sample(sample(resubmit.request_ids[0], b.prompt.uid, versions=[0, 0, 1, 1]), 5)
    assert rids(train.groups) == [[b.request_ids[0], resubmit.request_ids[0]]]  # b's finished sample kept


def test_a_sample_that_would_span_more_than_k_versions_is_regenerated():
    sched = build(prompts_per_step=1, group_size=2,
                  sorted={"rollout_prompts": 3, "mode": "partial", "max_versions": 2})
    a, b, c = sched.start(0.0)
    assert sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 1) == []
    _, train = sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 1)  # Train a at v0, abort b and c
    next_step(sched, 1, train.groups, 2)
    rb = [sched.on_abort(completion(rid, b.prompt.uid, 3, "abort"), 3)[0] for rid in b.request_ids]
    rc = [sched.on_abort(completion(rid, c.prompt.uid, 3, "abort"), 3)[0] for rid in c.request_ids]
    assert all(r.resume for r in rb + rc)  # span 2 at v1: within K
    assert sched.on_sample(sample(rb[0].request_ids[0], b.prompt.uid, 5, versions=[0, 0, 0, 1, 1]), 4) == []
    abort, train = sched.on_sample(sample(rb[1].request_ids[0], b.prompt.uid, 5, versions=[0, 0, 0, 1, 1]), 4)
    assert abort.request_ids == [r.request_ids[0] for r in rc]
    next_step(sched, 2, train.groups, 5)
    for rid in abort.request_ids:
        (again,) = sched.on_abort(completion(rid, c.prompt.uid, 5, "abort", [0, 0, 0, 1, 1]), 6)
        assert not again.resume and len(again.request_ids) == 1  # from v0 to v2 is 3 versions > K
    m = sched.metrics()
    assert m["sorted/regenerated"] == 2 and m["sorted/resumed"] == 4 and m["sorted/wasted_tokens"] == 10


def test_finished_samples_past_k_versions_are_regenerated_at_the_update():
    sched = build(prompts_per_step=1, group_size=2,
                  sorted={"rollout_prompts": 3, "mode": "partial", "max_versions": 2})
    a, b, c = sched.start(0.0)
    sched.on_sample(sample(c.request_ids[0], c.prompt.uid), 0)  # c: one sample done under v0
    sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 0)
    abort, train = sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 0)  # Train a at v0
    assert next_step(sched, 1, train.groups, 1) == []
    subs = [sched.on_abort(completion(rid, "", 0, "abort"), 1)[0] for rid in abort.request_ids]
    assert [(s.prompt, len(s.request_ids), s.resume) for s in subs] == [(b.prompt, 1, {})] * 2 + [(c.prompt, 1, {})]
    sched.on_sample(sample(subs[0].request_ids[0], b.prompt.uid, versions=[1] * 4), 2)
    abort, train = sched.on_sample(sample(subs[1].request_ids[0], b.prompt.uid, versions=[1] * 4), 2)
    assert train.groups[0].prompt == b.prompt and abort.request_ids == subs[2].request_ids
    (fresh,) = next_step(sched, 2, train.groups, 3)  # c's v0 sample would span 3 versions at v2
    assert fresh.prompt == c.prompt and len(fresh.request_ids) == 1 and not fresh.resume
    assert sched.metrics()["sorted/regenerated"] == 1 and sched.metrics()["sorted/wasted_tokens"] == 4


def test_engine_side_aborts_are_replaced_or_resumed_at_once():
    on_policy = build(prompts_per_step=1, group_size=2, sorted={"rollout_prompts": 1})
    (sub,) = on_policy.start(0.0)
    (again,) = on_policy.on_abort(completion(sub.request_ids[0], sub.prompt.uid, 3, "abort"), 1)
    assert len(again.request_ids) == 1 and not again.resume
    partial = build(prompts_per_step=1, group_size=2, sorted={"rollout_prompts": 1, "mode": "partial"})
    (sub,) = partial.start(0.0)
    (again,) = partial.on_abort(completion(sub.request_ids[0], sub.prompt.uid, 3, "abort"), 1)
    assert list(again.resume.values())[0].resume_ids == [7, 7, 7]
    assert partial.metrics()["sorted/engine_aborts"] == 1


def test_late_finish_of_an_aborted_request_is_kept_in_partial_mode():
    sched = build(prompts_per_step=1, group_size=2, sorted={"rollout_prompts": 2, "mode": "partial"})
    a, b = sched.start(0.0)
    assert sched.on_sample(sample(a.request_ids[0], a.prompt.uid), 1) == []
    _, first = sched.on_sample(sample(a.request_ids[1], a.prompt.uid), 1)  # Train a, abort b
    for rid in b.request_ids:
        assert sched.on_sample(sample(rid, b.prompt.uid), 2) == []  # b raced the abort
    (train,) = next_step(sched, 1, first.groups, 3)  # b completes the round's last batch at once
    assert rids(train.groups) == [b.request_ids]
    assert next_step(sched, 2, train.groups, 4)[0].prompt != b.prompt  # next round


def test_dynamic_sampling_drops_uniform_groups_and_fills_from_the_round():
    sched = build(prompts_per_step=2, group_size=2, sorted={"rollout_prompts": 8},
                  dynamic_sampling={"enabled": True})
    uniform = lambda prompt, lineage: 1.0 if prompt.index % 2 == 0 else float(lineage % 2)  # noqa: E731
    engine = FakeEngine(sched, reward=uniform, seed=4)
    engine.on_train = lambda v, groups: sched.ledger.check(sched.in_flight_prompts())
    engine.apply(sched.start(0.0))
    engine.run(6)
    groups = [g for _, gs in engine.trains for g in gs]
    assert groups and all(len(set(g.rewards)) > 1 for g in groups)
    assert sched.ledger.dropped["zero_variance"] > 0
    assert all(len(gs) == 2 for _, gs in engine.trains[:1])


def test_config_defaults_and_errors():
    sched = build(prompts_per_step=3, group_size=2)
    assert len(sched.start(0.0)) == 12 and sched.batch == 3  # 4 x the sizer's prompts
    cfg = Config()
    cfg.control.scheduler = "sorted"
    assert type(build_scheduler(cfg, PromptCursor(prompts(4)))).__name__ == "SortedScheduler"
    with pytest.raises(ValueError, match="rollout_prompts"):
        ControlConfig(sorted={"rollout_prompts": 2, "update_prompts": 3})
    with pytest.raises(ValueError):
        ControlConfig(sorted={"mode": "async"})
    with pytest.raises(ValueError, match="control.sorted.rollout_prompts=2"):
        build(prompts_per_step=3, sorted={"rollout_prompts": 2}).start(0.0)
    with pytest.raises(ValueError, match="must be at least 2: a group of one sample has no advantage"):
        build(group_size=1)


def test_versions_are_read_run_by_run_from_run_length_sequences():
    assert version_counts(Runs([(3, 4), (5, 2)])) == {3: 4, 5: 2} == version_counts([3, 3, 3, 3, 5, 5])
    assert version_counts(Runs([(3, 10 ** 12)])) == {3: 10 ** 12}  # token by token, it would never end
    assert span(version_counts([3, 5]), 6) == 4 and span(version_counts([]), 6) == 0


# --- checkpoints -------------------------------------------------------------------------------
def test_state_round_trip_regenerates_in_flight_samples_and_trains_each_prompt_once():
    control = dict(prompts_per_step=2, group_size=3, sorted={"rollout_prompts": 7, "mode": "partial"})
    a = build(**control)
    engine_a = FakeEngine(a, seed=5)
    saved = []

    def checkpoint():  # inside the second update, where the live controller saves
        if len(engine_a.trains) == 2:
            saved.append((json.loads(json.dumps(a.state_dict())), a.metrics(), set(engine_a.seen)))
    engine_a.on_update = checkpoint
    engine_a.apply(a.start(0.0))
    engine_a.run(2)
    ((state, metrics, seen),) = saved
    before = [g.prompt.uid for _, gs in engine_a.trains for g in gs]
    round_uids = {uid for uid, r in engine_a.round_of.items() if r == 1}
    open_uids = [e["prompt"]["uid"] for e in state["sorted"]["open"]]
    assert len(open_uids) == 3 and set(open_uids) == round_uids - set(before)

    b, c = build(**control), build(**control)
    b.load_state_dict(state)
    c.load_state_dict(json.loads(json.dumps(state)))
    assert b.metrics() == metrics and b.version == 2
    subs = b.start(0.0)
    assert [(s.prompt.uid, s.request_ids) for s in subs] == [(s.prompt.uid, s.request_ids) for s in c.start(0.0)]
    assert [s.prompt.uid for s in subs] == open_uids and all(len(s.request_ids) == 3 and not s.resume for s in subs)
    assert not {r for s in subs for r in s.request_ids} & seen  # ids continue past the saved ones
    engine_b = FakeEngine(b, seed=6)
    engine_b.version, engine_b.weight_times = b.version, [0.0] * b.version
    engine_b.apply(subs)
    engine_b.run(2)
    after = [g.prompt.uid for _, gs in engine_b.trains for g in gs]
    assert sorted(before + after) == sorted(round_uids)  # the round finished, each prompt once
    assert b.round == 2 and b.ledger.drawn == 14 and b.metrics()["sorted/max_delay_updates"] <= 4
    version, groups = engine_b.trains[0]  # regenerated under the restored weights
    assert version == 2 and all(set(s.completion.versions) == {2} for g in groups for s in g.samples)
    b.ledger.check(b.in_flight_prompts())


# --- invariants over random completion orders ----------------------------------------------------
def check_run(mode, batch, rollout, group, k, late, abort_delay, train_s, engine_aborts, dynamic, seed, trains=9):
    sched = build(prompts_per_step=batch, group_size=group, dynamic_sampling={"enabled": dynamic},
                  sorted={"mode": mode, "rollout_prompts": rollout, "max_versions": k})
    engine = FakeEngine(sched, length=lambda p, lineage: heavy_tailed(p, lineage, seed), late=late,
                        abort_delay=abort_delay, train_s=train_s, engine_aborts=engine_aborts, seed=seed)
    bound = 1 if mode == "on_policy" else k
    per_round = math.ceil(rollout / batch)
    trained_uids, trained_rids, spans, delays = [], set(), [], []

    def check(version, groups):
        sched.ledger.check(sched.in_flight_prompts())
        assert sched.version == version and not engine.live and not sched.running  # nothing generating
        assert 1 <= len(groups) <= batch
        finished = [max(engine.arrived[s.completion.request_id] for s in g.samples) for g in groups]
        assert finished == sorted(finished), "groups out of finish order"
        assert len({engine.round_of[g.prompt.uid] for g in groups}) == 1
        for g in groups:
            assert len(g.samples) == group and all(s.completion.prompt_uid == g.prompt.uid for s in g.samples)
            assert not dynamic or len(set(g.rewards)) > 1
            delays.append(len(engine.trains) - engine.first_train[g.prompt.uid])
            for s in g.samples:
                c = s.completion
                assert c.finish_reason == "stop" and len(set(c.token_ids)) == 1  # one lineage, in one piece
                full = heavy_tailed(g.prompt, c.token_ids[0], seed)  # its lineage's whole length
                assert c.num_tokens == len(c.logprobs) == len(c.versions) == full
                assert span(version_counts(c.versions), version) <= bound
                assert mode == "partial" or c.request_id not in engine.aborted
                spans.append(len(set(c.versions)))
                assert c.request_id not in trained_rids
                trained_rids.add(c.request_id)
        trained_uids.extend(g.prompt.uid for g in groups)

    engine.on_train = check
    engine.apply(sched.start(0.0))
    engine.run(trains)
    assert len(trained_uids) == len(set(trained_uids)), "a prompt was trained twice"
    drawn = set(engine.round_of)
    assert sched.ledger.drawn == len(drawn)
    assert len(drawn - set(trained_uids)) == sum(sched.ledger.dropped.values()) + sched.in_flight_prompts()
    assert max(delays) <= per_round, "a prompt waited longer than its round"
    m = sched.metrics()
    assert m["sorted/max_delay_updates"] == max(delays) and m["staleness/max_versions"] == max(spans) <= bound
    assert m["sorted/resumed"] == len(engine.resumes)
    if mode == "on_policy":
        assert m["sorted/resumed"] == 0 and m["staleness/mean"] == 0
    return sched, engine


def test_partial_mode_over_many_updates_resumes_and_bounds_staleness():
    sched, engine = check_run("partial", batch=4, rollout=16, group=4, k=3, late=0.1, abort_delay=2.0,
                              train_s=1.0, engine_aborts=0.05, dynamic=False, seed=3, trains=24)
    m = sched.metrics()
    assert m["sorted/resumed"] > 0 and m["sorted/regenerated"] > 0 and m["staleness/max_versions"] == 3
    assert 0 < m["staleness/mean"] < 2 and sched.round >= 6


@settings(max_examples=40, deadline=None, derandomize=True)
@given(mode=st.sampled_from(["on_policy", "partial"]), batch=st.integers(1, 4), extra=st.integers(0, 9),
       group=st.integers(2, 4), k=st.integers(1, 3), late=st.sampled_from([0.0, 0.3]),
       abort_delay=st.sampled_from([0.0, 3.0]), train_s=st.sampled_from([0.0, 2.0]),
       engine_aborts=st.sampled_from([0.0, 0.1]), dynamic=st.booleans(), seed=st.integers(0, 10**6))
def test_invariants_hold_for_random_completion_orders(mode, batch, extra, group, k, late, abort_delay, train_s,
                                                      engine_aborts, dynamic, seed):
    check_run(mode, batch, batch + extra, group, k, late, abort_delay, train_s, engine_aborts,
              dynamic, seed)
