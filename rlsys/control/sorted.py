"""`sorted`: SortedRL's online length-aware scheduling (docs/design.md "SortedRL"), as a pure policy.

A round is one SortedRL rollout group: N = `rollout_prompts` prompts (default 4 x the update batch
B) with G samples each, all submitted at once so the engine is oversubscribed. Groups complete in
the order they finish, short ones first; as soon as B are complete they are trained, in that order,
and every request still generating is aborted, as the engine is about to load new weights. After
the update (`on_trained`) the round's unfinished samples go back to the engine:

- `on_policy`: regenerated from scratch under fresh request ids. Every trained token comes from the
  weights current at its Train.
- `partial`: resumed with their tokens, behaviour log-probs and per-token versions (Submit.resume),
  to be trained with the decoupled PPO loss. A sample may span at most K = `max_versions` policy
  versions; one that would span more is regenerated from scratch (the cache bound).

The round's last Train takes what is left (it may hold fewer than B groups); the next round starts
only when every prompt of this one is trained or dropped, so no prompt waits more than ceil(N / B)
updates. B and G are read from the group sizer once per round.

Choices the abstract leaves open, and why:
- The bound counts versions from a sample's oldest token to the version it is trained at, not the
  distinct versions among its tokens: a sample finished under v and trained at v+3 has one version
  but is three updates off-policy. On_policy mode is exactly this rule with K = 1, so it also
  discards the finished samples of groups left incomplete at an update (their weights are gone).
- One Train at a time: the next waits for `on_trained`, so the version a Train is trained against
  is known when it is emitted and every sample in it is checked against that version.
- An aborted request answers with its partial output (`on_abort`) or, if it had just finished, a
  late sample; either may come before or after `on_trained`. Partial mode waits for whichever comes
  (a late sample is kept as finished if it is within the bound); on_policy mode regenerates at once
  and ignores both. Every sample is checked against the bound on arrival and at each update.
- DAPO dynamic sampling drops zero-variance groups; the oversubscribed round refills the batch by
  itself, so there are no extra rounds (only the round's last Train may come out smaller).
- Checkpoints keep the round's untrained prompts, not their samples: every sample in flight at a
  checkpoint is regenerated from scratch after a restore (see `state_dict`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from rlsys.control.actions import Abort, Train
from rlsys.control.scheduler import SCHEDULERS, Action, Scheduler, version_counts
from rlsys.types import Completion, Group, Prompt, Request, ScoredSample

OVERSUBSCRIPTION = 4  # default rollout group size, in update batches


def span(counts: Counter, version: int) -> int:
    """Policy versions from a sample's oldest token up to `version`, the one it is trained at."""
    return version - min(counts) + 1 if counts else 0


@dataclass
class Finished:
    sample: ScoredSample
    versions: Counter  # counted once on arrival: lists can be long and are checked at every update


@dataclass
class RoundPrompt:
    """One prompt of the round and where its G samples are."""
    prompt: Prompt
    drawn_at: int  # Trains emitted before it was drawn, for the delay metric
    owed: int = 0  # samples to generate from scratch at its next submission
    done: list[Finished] = field(default_factory=list)
    partials: list[Completion] = field(default_factory=list)  # aborted, to resume after the update
    closed: bool = False  # trained or dropped


@SCHEDULERS.register("sorted")
class SortedScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        opts = self.cfg.sorted
        self.resumes = opts.mode == "partial"
        self.max_versions = opts.max_versions if self.resumes else 1
        self.entries: list[RoundPrompt] = []  # the round, in draw order (one prompt may be drawn twice)
        self.open = 0  # entries neither trained nor dropped
        self.ready: list[int] = []  # complete entries waiting for a Train, in finish order
        self.running: dict[str, int] = {}  # request id -> entry, generating
        self.aborting: dict[str, int] = {}  # request id -> entry: aborted, its output not back yet
        self.batch = self.group_size = 0  # B and G of the round
        self.round = self.updates = 0  # rounds started, Trains emitted
        self.training = False  # a Train is out and its on_trained has not come back
        self.counts = Counter(regenerated=0, resumed=0, aborted=0, engine_aborts=0, wasted_tokens=0)
        self.trained_tokens = self.stale_tokens = 0  # for staleness/mean
        self.max_span = self.max_lag = self.max_delay = 0
        # Samples and tokens a restored checkpoint left out, counted as regenerated when `start` regenerates them.
        self.unsaved_samples = self.unsaved_tokens = 0

    # --- events ---------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """The next round, or the rest of this one: groups complete since the last Train may make a batch."""
        if not self.open:
            return self._start_round()
        self.counts.update(regenerated=self.unsaved_samples, wasted_tokens=self.unsaved_tokens)  # as _drop_stale does
        self.unsaved_samples = self.unsaved_tokens = 0
        self._drop_stale()
        return self._progress() or self._submit_all()

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        i = self._take(sample.completion.request_id)
        if i is None:
            return []  # aborted in on_policy mode, or not ours
        entry, counts = self.entries[i], version_counts(sample.completion.versions)
        if not self.training and span(counts, self.version) > self.max_versions:
            self._discard(entry, sample.completion.num_tokens)  # from weights already replaced
            return self._submit_entry(i)
        entry.done.append(Finished(sample, counts))
        if len(entry.done) == self.group_size:
            if self.drop_uninformative(self._group(entry)):
                self._close(entry)
            else:
                self.ready.append(i)
        return self._progress()

    def on_abort(self, completion: Completion, now: float) -> list[Action]:
        rid = completion.request_id
        if rid in self.aborting:
            i = self.aborting.pop(rid)
        elif rid in self.running:  # aborted by the engine, not by us: replace or resume it
            i = self._take(rid)
            self.counts["engine_aborts"] += 1
        else:
            self.counts["wasted_tokens"] += completion.num_tokens
            return []
        entry = self.entries[i]
        if self.resumes:
            entry.partials.append(completion)
        else:
            self._discard(entry, completion.num_tokens)
        return [] if self.training else self._submit_entry(i)

    def on_trained(self, version: int, groups: list[Group]) -> None:
        super().on_trained(version, groups)
        self.training = False

    # --- the round ------------------------------------------------------------------------
    def _start_round(self) -> list[Action]:
        shape, opts = self.sizer.next_shape(), self.cfg.sorted
        self.batch, self.group_size = opts.update_prompts or shape.prompts, shape.group_size
        n = opts.rollout_prompts or OVERSUBSCRIPTION * self.batch
        if n < self.batch:
            raise ValueError(f"control.sorted.rollout_prompts={n} is smaller than the update batch "
                             f"of {self.batch} prompts; raise it or set control.sorted.update_prompts")
        self.round += 1
        self.entries = [RoundPrompt(p, self.updates, owed=self.group_size) for p in self.draw(n)]
        self.open, self.ready = n, []
        return self._submit_all()

    def _progress(self) -> list[Action]:
        """Train once B groups are complete, or all that is left of the round; next round when done."""
        if self.training:
            return []
        if not self.open:  # every prompt left was dropped
            return self._start_round()
        if len(self.ready) >= min(self.batch, self.open):
            return self._train()
        return []

    def _train(self) -> list[Action]:
        take, self.ready = self.ready[: self.batch], self.ready[self.batch:]
        self.updates += 1
        self.training = True
        groups = []
        for i in take:
            entry = self.entries[i]
            self._record(entry)
            groups.append(self._group(entry))
            self._close(entry)
        self.ledger.train(len(groups))
        return self._abort_running() + [Train(groups)]

    def _abort_running(self) -> list[Action]:
        ids = list(self.running)
        for rid in ids:
            i = self._take(rid)
            if self.resumes:
                self.aborting[rid] = i  # its tokens come back through on_abort
            else:
                self._discard(self.entries[i], 0)  # its tokens are counted as wasted when they come back
        self.counts["aborted"] += len(ids)
        return [Abort(ids)] if ids else []

    def _drop_stale(self) -> None:
        """After an update, regenerate finished samples that would now span more than K versions."""
        for i, entry in enumerate(self.entries):
            keep, stale = [], []
            for f in entry.done:
                (stale if span(f.versions, self.version) > self.max_versions else keep).append(f)
            if not stale:
                continue
            for f in stale:
                self._discard(entry, f.sample.completion.num_tokens)
            entry.done = keep
            if i in self.ready:
                self.ready.remove(i)

    def _submit_all(self) -> list[Action]:
        return [a for i, entry in enumerate(self.entries) if not entry.closed for a in self._submit_entry(i)]

    def _submit_entry(self, i: int) -> list[Action]:
        """Send entry i's owed samples from scratch and its partials as resumes (or from scratch if stale)."""
        entry = self.entries[i]
        fresh, resumes = entry.owed, []
        for partial in entry.partials:
            if not partial.num_tokens:
                fresh += 1
            elif span(version_counts(partial.versions), self.version) > self.max_versions:
                self._discard(entry, partial.num_tokens)
                fresh += 1
            else:
                resumes.append(partial)
        entry.owed, entry.partials = 0, []
        if not fresh + len(resumes):
            return []
        action = self.submit(entry.prompt, fresh + len(resumes))
        for rid, partial in zip(action.request_ids[fresh:], resumes):
            action.resume[rid] = Request(rid, partial.prompt_uid, partial.prompt_ids, **partial.resume_fields())
        self.running.update((rid, i) for rid in action.request_ids)
        self.counts["resumed"] += len(resumes)
        return [action]

    # --- small helpers ----------------------------------------------------------------------
    def _take(self, request_id: str) -> int | None:
        """The entry of a request we are waiting for, which stops waiting; None if we are not."""
        if request_id in self.running:
            self.finish(request_id)
            return self.running.pop(request_id)
        return self.aborting.pop(request_id, None)

    def _discard(self, entry: RoundPrompt, tokens: int) -> None:
        entry.owed += 1
        self.counts["regenerated"] += 1
        self.counts["wasted_tokens"] += tokens

    def _close(self, entry: RoundPrompt) -> None:
        entry.closed, entry.done = True, []
        self.open -= 1

    def _group(self, entry: RoundPrompt) -> Group:
        return Group(entry.prompt, [f.sample for f in entry.done])

    def _record(self, entry: RoundPrompt) -> None:
        """Staleness and delay of a group about to be trained at `self.version`."""
        self.max_delay = max(self.max_delay, self.updates - entry.drawn_at)
        for f in entry.done:
            if f.versions:
                self.max_span = max(self.max_span, len(f.versions))
                self.max_lag = max(self.max_lag, self.version - min(f.versions))
                self.stale_tokens += sum((self.version - v) * n for v, n in f.versions.items())
                self.trained_tokens += sum(f.versions.values())

    # --- accounting -----------------------------------------------------------------------
    def in_flight_prompts(self) -> int:
        return self.open

    def metrics(self) -> dict[str, float]:
        """Counters and staleness over the whole run; the bounds hold run-wide."""
        out = super().metrics()
        out.update({"staleness/max_versions": self.max_span, "staleness/max": self.max_lag,
                    "staleness/mean": self.stale_tokens / self.trained_tokens if self.trained_tokens else 0.0,
                    "sorted/deferred_prompts": self.open, "sorted/max_delay_updates": self.max_delay,
                    "sorted/round": self.round})
        out.update({f"sorted/{k}": v for k, v in self.counts.items()})
        return out

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The round's untrained prompts and its shape, not their samples.

        Take it once the trainer has applied every Train emitted (the live controller saves inside
        its train step). Whatever is in flight then (requests generating or aborted, finished
        samples, partials, groups waiting for a batch) is left out: after a restore, `start`
        regenerates every open prompt of the round from scratch under the restored weights, and the
        round goes on with its remaining updates, so each prompt is still trained exactly once. The
        samples left out are counted as regenerated then, so that a resumed run reports the waste an
        uninterrupted one does.
        """
        state = super().state_dict()
        open_entries = [e for e in self.entries if not e.closed]
        left_out = [f.sample.completion.num_tokens for e in open_entries for f in e.done]
        left_out += [p.num_tokens for e in open_entries for p in e.partials]
        state["sorted"] = {
            "open": [{"prompt": asdict(e.prompt), "drawn_at": e.drawn_at} for e in open_entries],
            "left_out": [len(left_out) + len(self.aborting), sum(left_out)],  # samples, tokens
            "batch": self.batch, "group_size": self.group_size, "round": self.round, "updates": self.updates,
            "counts": dict(self.counts), "tokens": [self.trained_tokens, self.stale_tokens],
            "maxima": [self.max_span, self.max_lag, self.max_delay]}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        s = state["sorted"]
        self.batch, self.group_size, self.round, self.updates = s["batch"], s["group_size"], s["round"], s["updates"]
        self.unsaved_samples, self.unsaved_tokens = s["left_out"]
        self.entries = [RoundPrompt(Prompt(**e["prompt"]), e["drawn_at"], owed=self.group_size) for e in s["open"]]
        self.open, self.ready, self.running, self.aborting, self.training = len(self.entries), [], {}, {}, False
        self.counts = Counter(s["counts"])
        self.trained_tokens, self.stale_tokens = s["tokens"]
        self.max_span, self.max_lag, self.max_delay = s["maxima"]
