"""Pre-emption: a run stopped at a checkpoint and resumed trains what the uninterrupted run trains.

Every scheduler and group sizer, driven by a deterministic cluster on a fake clock the way the live
controller drives them (rlsys/train.py): after each update `on_trained` closes the step, the scheduler's
state is saved as JSON, then `start` begins the next step. A resumed run builds everything afresh, loads
the state of step k and calls `start`, as `Controller._restore` and `run` do.

What a request produces (length, reward, speed) is a pure function of its request id, and a restored
scheduler continues the request ids, so the cluster needs nothing but the clock and the version to
be restored. Where the scheduler holds nothing in flight across the update (or regenerates it in the
uninterrupted run as well: sorted on_policy), the resumed run must equal the uninterrupted one step
for step. Where in-flight work is kept across updates (sorted partial mid-round, async with eta > 0),
the checkpoint drops it by design and regenerates it (see their `state_dict`), so timing differs and
only what the design promises is checked: the same prompt stream, each prompt trained once, the
bounds, and a resume that is itself deterministic.
"""
import heapq
import json
import math
import random
import zlib
from bisect import bisect_right
from collections import defaultdict

import pytest

from rlsys.config import ControlConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.scheduler import version_counts
from rlsys.control.sorted import span
from rlsys.data.cursor import PromptCursor
from rlsys.types import Completion, Prompt, ScoredSample

STEPS = 9
SEED = 7


class RecordingCursor(PromptCursor):
    """The data cursor, noting every prompt it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[str] = []

    def take(self, n):
        prompts = super().take(n)
        self.log += [p.uid for p in prompts]
        return prompts


def build(scheduler, sizer, control):
    rule = "constant_prompts" if scheduler == "async" else "constant_samples"  # async keeps B prompts
    # sagc's delta: a budget these lengths let it spend, so its sizes move and every case has its checkpoint
    cfg = ControlConfig(scheduler=scheduler, group_sizer=sizer, prompts_per_step=4, group_size=4,
                        sagc={"sizes": [2, 4, 8], "delta": 0.2, "prompt_rule": rule}, **control)
    cursor = RecordingCursor([Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(5000)], seed=1)
    return SCHEDULERS.get(scheduler)(cfg, cursor, GROUP_SIZERS.get(sizer)(cfg))


def outcome(key: int, prompt: Prompt):
    """(tokens, seconds per token, reward) of the sample started by request `key`: heavy-tailed lengths,
    every 5th prompt long; prompts always right, always wrong or a coin, so some groups have no variance."""
    rng = random.Random(key)
    scale = 6.0 if prompt.index % 5 == 0 else 1.0
    tokens = max(1, min(int(4 * scale * rng.paretovariate(1.5)), 300))
    p = (0.0, 0.5, 0.5, 1.0)[prompt.index % 4]
    return tokens, 1.0 + rng.random(), float(rng.random() < p)


class Cluster:
    """An unbounded engine, an abort that answers `abort_s` later, a trainer that takes `train_s`.

    A sample's token ids all hold its lineage key (the crc of the request that started it), so a
    partial rollout resumed under a new request id ends where its lineage would have. Tokens are
    stamped with the version loaded when they were generated.
    """

    def __init__(self, sched, now=0.0, version=0, train_s=3.0, abort_s=1.0):
        self.sched, self.now, self.version = sched, now, version
        self.train_s, self.abort_s = train_s, abort_s
        self.weight_times = [now] * version
        self.events, self.seq = [], 0
        self.live = {}  # request id -> (prompt, lineage key, versions of resumed tokens, start, tokens left)
        self.training = None  # the groups of the Train in progress
        self.steps = []  # per trained step: what was trained and the figures logged
        self.saved = {}  # step -> (scheduler state as written to the checkpoint, clock)
        self.seen = set()

    def push(self, dt, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (self.now + dt, self.seq, kind, payload))

    def output(self, rid, new, reason):
        prompt, key, resumed, start, _ = self.live.pop(rid)
        seconds = outcome(key, prompt)[1]
        versions = resumed + [bisect_right(self.weight_times, start + i * seconds) for i in range(new)]
        return Completion(rid, prompt.uid, [1], [key] * len(versions), [-0.5] * len(versions), versions, reason)

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                for rid in a.request_ids:
                    assert rid not in self.seen, f"request id {rid} reused"
                    self.seen.add(rid)
                    resume = a.resume.get(rid)
                    key = resume.resume_ids[0] if resume else zlib.crc32(f"{SEED}/{rid}".encode())
                    resumed = list(resume.resume_versions) if resume else []
                    tokens, seconds, _ = outcome(key, a.prompt)
                    left = max(tokens - len(resumed), 1)
                    self.live[rid] = (a.prompt, key, resumed, self.now, left)
                    self.push(left * seconds, "done", rid)
            elif isinstance(a, Abort):
                for rid in a.request_ids:
                    if rid in self.live:
                        prompt, key, _, start, left = self.live[rid]
                        new = min(int((self.now - start) / outcome(key, prompt)[1]), left - 1)
                        self.push(self.abort_s, "aborted", self.output(rid, new, "abort"))
            elif isinstance(a, Train):
                assert self.training is None, "one Train at a time"
                self.training = a.groups
                self.push(self.train_s, "trained", None)
            else:
                assert isinstance(a, Accumulate)  # streamed training is not modelled

    def run(self, steps):
        """Deliver events until `steps` updates have landed (counting those before a restore)."""
        while self.version < steps:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "done" and payload in self.live:
                prompt, key, _, _, left = self.live[payload]
                reward = outcome(key, prompt)[2]
                self.apply(self.sched.on_sample(ScoredSample(self.output(payload, left, "stop"), reward), self.now))
            elif kind == "aborted":
                self.apply(self.sched.on_abort(payload, self.now))
            elif kind == "trained":
                self.trained(steps)

    def trained(self, last):
        """What Controller.finish_training does, checkpoint at every step included."""
        groups, self.training = self.training, None
        versions = [version_counts(s.completion.versions) for g in groups for s in g.samples]
        at = self.version  # the version these groups were trained against
        self.version += 1
        self.weight_times.append(self.now)
        sched = self.sched
        sched.on_trained(self.version, groups)
        self.steps.append({
            "prompts": [g.prompt.uid for g in groups], "rewards": [g.rewards for g in groups],
            "group_sizes": [len(g.samples) for g in groups], "lags": [at - min(v) for v in versions],
            "spans": [span(v, at) for v in versions], "oldest": min(min(v) for v in versions),
            "metrics": sched.metrics()})
        self.saved[self.version] = (json.loads(json.dumps(sched.state_dict())), self.now)
        if self.version < last:
            self.apply(sched.start(self.now))


def uninterrupted(scheduler, sizer, control):
    sched = build(scheduler, sizer, control)
    cluster = Cluster(sched)
    cluster.apply(sched.start(0.0))
    cluster.run(STEPS)
    return sched, cluster


def resumed(scheduler, sizer, control, state, now, k):
    """A new process: fresh cursor, sizer and scheduler, the state of step k, a cluster at its clock."""
    sched = build(scheduler, sizer, control)
    sched.load_state_dict(json.loads(json.dumps(state)))
    cluster = Cluster(sched, now=now, version=k)
    cluster.loaded = sched.metrics()
    cluster.apply(sched.start(now))
    cluster.run(STEPS)
    return sched, cluster


def check_accounting(first, k, second):
    """Each prompt drawn across the interruption is trained once, dropped for a counted reason, or open."""
    sched_a, a = first
    sched_b, b = second
    state = a.saved[k][0]
    drawn = sched_a.cursor.log[:state["cursor"]["drawn"]] + sched_b.cursor.log
    assert len(set(drawn)) == len(drawn), "the test needs a dataset large enough to draw no prompt twice"
    trained = [u for s in a.steps[:k] + b.steps for u in s["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice across the interruption"
    assert set(trained) <= set(drawn)
    ledger = sched_b.ledger
    assert ledger.drawn == len(drawn) and ledger.trained == len(trained)
    assert set(ledger.dropped) <= {"zero_variance"}
    assert len(drawn) - len(trained) == sum(ledger.dropped.values()) + sched_b.in_flight_prompts()
    # the resumed run draws the prompts the uninterrupted run draws next, in its order
    n = min(len(sched_a.cursor.log), len(drawn))
    assert drawn[:n] == sched_a.cursor.log[:n]


# (scheduler, control, saved state where the checkpoint is the interesting one)
EXACT = {
    "sync": ("sync", {}, lambda s: True),
    "sync_dapo": ("sync", {"dynamic_sampling": {"enabled": True}}, lambda s: s["ledger"]["dropped"]),
    "tail": ("tail", {"tail": {"eta_p": 1.5}}, lambda s: s["tail"]["queue"]),
    "sorted_on_policy": ("sorted", {"sorted": {"rollout_prompts": 10}}, lambda s: s["sorted"]["open"]),
    "sorted_on_policy_dapo": ("sorted", {"sorted": {"rollout_prompts": 10}, "dynamic_sampling": {"enabled": True}},
                              lambda s: s["sorted"]["open"]),
    "sorted_partial_round_end": ("sorted", {"sorted": {"rollout_prompts": 10, "mode": "partial", "max_versions": 3}},
                                 lambda s: s["sorted"]["round"] > 1 and not s["sorted"]["open"]),
    "async_eta0": ("async", {"staleness": {"eta": 0}}, lambda s: True),
    "async_eta0_dapo": ("async", {"staleness": {"eta": 0}, "dynamic_sampling": {"enabled": True}},
                        lambda s: s["ledger"]["dropped"]),
}


def checkpoint_step(cluster, interesting):
    """The first step from 3 on (so sagc has moved) whose checkpoint is an interesting one."""
    k = next((k for k in range(3, STEPS - 1) if interesting(cluster.saved[k][0])), None)
    assert k is not None, "no checkpoint of the kind this case is about"
    return k


@pytest.mark.parametrize("sizer", ["fixed", "sagc"])
@pytest.mark.parametrize("case", EXACT)
def test_resumed_run_trains_the_same_prompts_rewards_and_group_sizes(case, sizer):
    scheduler, control, interesting = EXACT[case]
    first = uninterrupted(scheduler, sizer, control)
    sched_a, a = first
    k = checkpoint_step(a, interesting)
    state, now = a.saved[k]
    second = resumed(scheduler, sizer, control, state, now, k)
    sched_b, b = second
    assert b.loaded == a.steps[k - 1]["metrics"]  # the figures logged at the checkpoint, restored
    assert b.steps == a.steps[k:]  # prompts, rewards, group sizes, staleness and every logged figure
    assert sched_b.state_dict() == sched_a.state_dict()
    check_accounting(first, k, second)
    if sizer == "sagc" and scheduler != "async":  # async reads G only; it is the sizer's state that matters
        assert len({s["metrics"]["group_size"] for s in a.steps}) > 1, "sagc never changed G: a weak test"


# In-flight work kept across updates, dropped by the checkpoint and regenerated (see the module doc).
REGENERATED = {
    "sorted_partial_mid_round": ("sorted", {"sorted": {"rollout_prompts": 10, "mode": "partial", "max_versions": 3}}),
    "async_eta2": ("async", {"staleness": {"eta": 2}}),
}


@pytest.mark.parametrize("sizer", ["fixed", "sagc"])
@pytest.mark.parametrize("case", REGENERATED)
def test_resume_regenerates_in_flight_work_and_trains_each_open_prompt_once(case, sizer):
    scheduler, control = REGENERATED[case]
    first = uninterrupted(scheduler, sizer, control)
    sched_a, a = first
    key = "sorted" if scheduler == "sorted" else "async"
    k = checkpoint_step(a, lambda s: s[key]["open"])
    state, now = a.saved[k]
    second = resumed(scheduler, sizer, control, state, now, k)
    sched_b, b = second
    assert b.steps == resumed(scheduler, sizer, control, state, now, k)[1].steps  # the resume is deterministic
    logged = dict(a.steps[k - 1]["metrics"], **{"async/buffered_groups": 0} if scheduler == "async" else {})
    assert b.loaded == logged  # the figures logged at the checkpoint, restored (buffered groups are regenerated)
    check_accounting(first, k, second)
    open_uids = {p["prompt"]["uid"] if scheduler == "sorted" else p["uid"] for p in state[key]["open"]}
    if scheduler == "sorted":  # the round is finished before the next starts: at most ceil(open / B) updates
        assert a.steps[-1]["metrics"]["sorted/resumed"] > 0, "no partial rollout was resumed: a weak test"
        soon = [u for s in b.steps[:math.ceil(len(open_uids) / state["sorted"]["batch"])] for u in s["prompts"]]
        assert open_uids == set(soon)
        assert max(sp for s in b.steps for sp in s["spans"]) <= 3
        whole, broken = rounds(a.steps), rounds(a.steps[:k] + b.steps)
        done = min(max(whole), max(broken))  # rounds finished in both runs train the same prompts
        assert done > state["sorted"]["round"], "the interrupted round did not finish in both runs"
        assert {r: whole[r] for r in range(1, done)} == {r: broken[r] for r in range(1, done)}
    else:  # re-admitted at version k, so trained by version k + eta
        assert a.steps[-1]["metrics"]["staleness/max"] > 0, "nothing was generated across an update: a weak test"
        assert open_uids <= {u for s in b.steps[:3] for u in s["prompts"]}
        assert max(lag for s in b.steps for lag in s["lags"]) <= 2
    assert b.steps[0]["oldest"] >= k  # regenerated under the restored weights


def rounds(steps):
    """Round -> the prompts trained in it (sorted)."""
    out = defaultdict(set)
    for step in steps:
        out[step["metrics"]["sorted/round"]] |= set(step["prompts"])
    return out
