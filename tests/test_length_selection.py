"""Length selection (rlsys/control/selection.py): trained lengths against the lengths the policy generates, on
scripted lengths; schedulers driven through `handle` and `on_trained` as the live controller drives them."""
import heapq
import json
import math
import random
import zlib

import pytest

from rlsys.config import ControlConfig, TailConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.events import Aborted, Scored
from rlsys.control.selection import LengthSelection, dropped_by_decile
from rlsys.control.sync import SyncScheduler
from rlsys.data.cursor import PromptCursor
from rlsys.types import Completion, Group, Prompt, ScoredSample


def prompts(n):
    return [Prompt(f"train-{i}", f"q{i}", str(i), index=i) for i in range(n)]


def output(rid, uid, versions, reason="stop"):
    return Completion(rid, uid, [1], [3] * len(versions), [-0.1] * len(versions), list(versions), reason)


def heavy_tailed(uid, rid):
    """Every 5th prompt is long; a Pareto draw per request."""
    rng = random.Random(zlib.crc32(rid.encode()))
    scale = 6.0 if int(uid.split("-")[1]) % 5 == 0 else 1.0
    return max(1, min(int(8 * scale * rng.paretovariate(1.5)), 600))


def coin(rid):
    return float(random.Random(zlib.crc32(rid.encode()) + 1).random() < 0.5)


class FirstFinishers(SyncScheduler):
    """The selection the old tail made: ceil(1.25 R) samples per prompt, the first R to finish trained, the
    others aborted at once."""

    def submit(self, prompt, n):
        return super().submit(prompt, math.ceil(1.25 * n))

    def on_sample(self, sample, now):
        uid = self.prompt_of.get(sample.completion.request_id)
        actions = super().on_sample(sample, now)
        builder = self.pending.get(uid)
        if uid is None or (builder is not None and not builder.complete):
            return actions
        extras = [rid for rid, u in self.prompt_of.items() if u == uid]
        for rid in extras:
            self.finish(rid)
        return ([Abort(extras)] if extras else []) + actions


class Engine:
    """Unbounded slots on a fake clock: one token per time unit, each stamped with the version the engine serves;
    an abort answers at once with the tokens so far. A Train takes no time: the scheduler hears `on_trained`, then
    `start`, as from the live controller."""

    def __init__(self, sched):
        self.sched, self.now, self.version, self.seq = sched, 0.0, 0, 0
        self.events, self.live, self.trains = [], {}, 0

    def push(self, at, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                assert not a.resume
                for rid in a.request_ids:
                    self.live[rid] = (a.prompt.uid, self.now, self.version)
                    self.push(self.now + heavy_tailed(a.prompt.uid, rid), "done", rid)
            elif isinstance(a, Abort):
                for rid in a.request_ids:
                    uid, start, version = self.live.pop(rid)
                    tokens = min(int(self.now - start), heavy_tailed(uid, rid) - 1)
                    self.push(self.now, "aborted", output(rid, uid, [version] * tokens, "abort"))
            elif isinstance(a, Train):
                self.push(self.now, "trained", a.groups)
            else:
                assert isinstance(a, Accumulate)

    def run(self, trains):
        self.apply(self.sched.start(0.0))
        while self.trains < trains:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "trained":
                self.trains += 1
                self.version += 1
                self.sched.on_trained(self.version, payload)
                self.apply(self.sched.start(self.now))
            elif kind == "aborted":
                self.apply(self.sched.handle(Aborted(payload), self.now))
            elif payload in self.live:
                uid, start, version = self.live.pop(payload)
                c = output(payload, uid, [version] * heavy_tailed(uid, payload))
                self.apply(self.sched.handle(Scored(ScoredSample(c, coin(payload))), self.now))
        return self.sched.metrics()


def build(scheduler, **control):
    cfg = ControlConfig(scheduler=scheduler, prompts_per_step=4, group_size=4, **control)
    cls = FirstFinishers if scheduler == "first-finishers" else SCHEDULERS.get(scheduler)
    return cls(cfg, PromptCursor(prompts(3000), seed=1), GROUP_SIZERS.get("fixed")(cfg))


# --- schedulers -------------------------------------------------------------------------------
def test_sync_trains_exactly_what_it_generates():
    sched = build("sync")
    engine = Engine(sched)
    for _ in range(5):  # every step, not only the run
        m = engine.run(engine.trains + 1)
        assert m["length/selection"] == 1.0 and m["length/selection_run"] == 1.0
    assert all(m[f"length/dropped_share_d{k}"] == 0.0 for k in range(1, 11))


def test_keeping_the_first_finishers_of_each_prompt_is_length_selection():
    sched = build("first-finishers")
    m = Engine(sched).run(40)
    assert m["length/selection_run"] < 0.95
    # it leaves out 1 sample in 5: hardly any of the shortest tenth, far more of the longest
    assert m["length/dropped_share_d1"] < 0.05 and m["length/dropped_share_d10"] > 0.3


@pytest.mark.parametrize("scheduler,control", [
    ("sync", {}),
    ("sorted", {}),  # on_policy: a prompt left incomplete at an update is regenerated whole
    # a short round defers whole prompts to a long round, trained whole (RollPacker's rule)
    pytest.param("tail", {}, marks=pytest.mark.xfail(
        "eta_r" in TailConfig.model_fields, strict=False,
        reason="the tail committed before issue 62 part 1 keeps each prompt's first R of ceil(eta_r R) samples to "
               "finish (0.94 here); remove this mark once the prompt-level tail has landed")),
])
def test_schedulers_that_claim_to_be_on_policy_train_the_lengths_they_generate(scheduler, control):
    sched = build(scheduler, **control)
    m = Engine(sched).run(40)
    assert abs(m["length/selection_run"] - 1.0) <= 0.05, m
    assert sum(sched.selection.generated.values()) >= 40 * 4 * 4  # it counted every trained sample at least


# --- the accounting -----------------------------------------------------------------------------
def group(uid, *completions):
    return Group(Prompt(uid, "q", "a"), [ScoredSample(c, 1.0) for c in completions])


def test_a_prompt_deferred_whole_and_regenerated_counts_at_the_version_it_is_trained_at():
    sel = LengthSelection()
    sel.seen(output("a#0", "a", [0] * 3), 0)
    sel.seen(output("b#1", "b", [0] * 50, "abort"), 0)  # b is deferred: its samples of version 0 are left out
    sel.trained([group("a", output("a#0", "a", [0] * 3))], 1)
    assert sel.metrics()["length/selection"] == 1.0
    sel.seen(output("b#2", "b", [1] * 80), 1)  # regenerated whole under version 1
    sel.trained([group("b", output("b#2", "b", [1] * 80))], 2)
    assert sel.metrics()["length/selection"] == 1.0 and sel.metrics()["length/selection_run"] == 1.0


def test_a_cut_sibling_of_a_trained_sample_counts_at_the_length_it_reached_even_when_it_comes_back_late():
    sel = LengthSelection()
    sel.seen(output("a#0", "a", [0] * 10), 0)
    sel.trained([group("a", output("a#0", "a", [0] * 10))], 1)
    sel.seen(output("a#1", "a", [0] * 30, "abort"), 1)  # its abort answered after the update
    sel.trained([], 2)
    m = sel.metrics()
    assert m["length/selection_run"] == pytest.approx(10 / 20)
    assert "length/selection" not in m  # the step that counted it trained nothing: it has no ratio


def test_a_resumed_sample_counts_once_at_its_end():
    sel = LengthSelection()
    sel.seen(output("a#0", "a", [0] * 4, "abort"), 0)  # cut at the update...
    sel.seen(output("a#1", "a", [0] * 4, "abort"), 0)  # (a sibling cut at the same length: one of two resumed)
    sel.trained([], 1)
    sel.seen(output("a#2", "a", [0] * 4 + [1] * 6), 1)  # ...resumed as a#2 and finished under version 1
    sel.seen(output("a#3", "a", [0] * 7), 1)
    sel.trained([group("a", output("a#2", "a", [0] * 4 + [1] * 6), output("a#3", "a", [0] * 7))], 2)
    # generated: 10 and 7 trained, and the one cut sibling never resumed, at 4
    assert sel.metrics()["length/selection"] == pytest.approx((17 / 2) / (21 / 3))
    assert sum(sel.generated.values()) == 3 and sel.dropped == {4: 1}


def test_samples_that_never_began_are_not_generated_and_the_run_counts_survive_a_checkpoint():
    sel = LengthSelection()
    sel.seen(output("a#0", "a", [], "abort"), 0)
    sel.seen(output("a#1", "a", [0] * 5), 0)
    sel.seen(output("a#2", "a", [0] * 9, "abort"), 0)
    sel.trained([group("a", output("a#1", "a", [0] * 5))], 1)
    restored = LengthSelection()
    restored.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert restored.generated == sel.generated == {5: 1, 9: 1}
    assert restored.metrics()["length/selection_run"] == sel.metrics()["length/selection_run"] == 5 / 7


def test_dropped_share_by_decile_splits_one_length_over_the_deciles_its_ranks_fall_in():
    generated = {k: 1 for k in range(1, 11)}
    assert dropped_by_decile(generated, {10: 1}) == [0.0] * 9 + [1.0]
    # 20 samples of one length, 5 dropped: every decile holds two of them, a quarter dropped
    assert dropped_by_decile({7: 20}, {7: 5}) == pytest.approx([0.25] * 10)
    # 15 samples: deciles of 1.5 samples; the 5 long ones (all dropped) fill the last three deciles and a third
    assert dropped_by_decile({1: 10, 2: 5}, {2: 5}) == pytest.approx([0.0] * 6 + [1 / 3] + [1.0] * 3)
