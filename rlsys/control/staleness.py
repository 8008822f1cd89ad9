"""`async`: rollout and training overlap, with staleness bounded by eta (docs/design.md "Asynchronous mode").

Counting is in prompts: admitting a prompt submits its G samples at once, and B is
`control.prompts_per_step`. With trained, buffered and generating prompts counted (dropped ones
not), a prompt is admitted at version v only while

    (trained + buffered + generating) // B <= v + eta        (AReaL's rule; eta = control.staleness.eta)

Complete groups wait in a buffer; a Train of exactly B groups is emitted as soon as one can be, and
the next waits for `on_trained`. Requests in flight are never aborted: they go on under the new
weights, each token tagged with its version. The driver runs a Train in the background, keeps
delivering samples meanwhile, and calls `on_trained(v, groups)` then `start` once every engine has loaded
version v.

AReaL's rule alone does not bound a sample's staleness when groups are trained in finish order: a
long group admitted at v can be overtaken by shorter ones again and again. So each prompt has a
deadline v + eta, Trains take groups earliest deadline first (finish order among equals), and a
Train waits while it would leave more groups due by some version d than the Trains up to d can
hold. With the rule above this is always satisfiable once the groups finish, and it gives the bound:
a prompt admitted at version v is trained at version <= v + eta, so every token of it is at most eta
versions old. With eta = 0 it is the `sync` schedule, Train for Train, except under DAPO dynamic
sampling: a dropped group frees its place at once (no rounds, no cap), so every Train holds B groups.

The group size G comes from the group sizer at each update and applies to prompts admitted after
it. B stays fixed, as the bound is counted in batches of it: the config refuses a sizer rule that
would change the prompt count (sagc's constant_samples).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from rlsys.control.actions import Train
from rlsys.control.scheduler import SCHEDULERS, Action, Scheduler, version_counts
from rlsys.types import Completion, Group, Prompt, ScoredSample


@dataclass
class AdmittedPrompt:
    """An admitted prompt until it is trained or dropped."""
    prompt: Prompt
    deadline: int  # version it must be trained at, at the latest: admission version + eta
    group_size: int
    samples: list[ScoredSample] = field(default_factory=list)


@SCHEDULERS.register("async")
class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eta, self.batch = self.cfg.staleness.eta, self.cfg.prompts_per_step
        self.group_size = 0
        self.running: dict[str, AdmittedPrompt] = {}  # request id -> its prompt
        self.ready: list[AdmittedPrompt] = []  # complete groups, in finish order
        self.ready_due = Counter()  # deadline -> groups in `ready`
        self.due = Counter()  # deadline -> prompts admitted and not yet trained or dropped
        self.restored: list[Prompt] = []  # open prompts of a checkpoint, to regenerate at start
        self.training = False  # a Train is out and its on_trained has not come back
        self.counts = Counter(deadline_waits=0, engine_aborts=0)
        self.lag_sum = self.lag_samples = self.lag_max = 0

    # --- events ---------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self.group_size = self.sizer.next_shape().group_size
        restored, self.restored = self.restored, []
        train = self._train()  # first, so the trainer starts before the engines are sent the new prompts
        return train + [self._admit(p) for p in restored] + self._fill()

    def on_sample(self, sample: ScoredSample, now: float) -> list[Action]:
        rid = sample.completion.request_id
        entry = self.running.pop(rid, None)
        if entry is None:
            return []
        self.finish(rid)
        entry.samples.append(sample)
        if len(entry.samples) < entry.group_size:
            return []
        if self.drop_uninformative(Group(entry.prompt, entry.samples)):
            self.due[entry.deadline] -= 1
            return self._fill()
        self.ready.append(entry)
        self.ready_due[entry.deadline] += 1
        return self._train()

    def on_abort(self, completion: Completion, now: float) -> list[Action]:
        """Only the engine aborts (this scheduler never does): generate that sample again."""
        entry = self.running.pop(completion.request_id, None)
        if entry is None:
            return []
        self.finish(completion.request_id)
        self.counts["engine_aborts"] += 1
        action = self.submit(entry.prompt, 1)
        self.running[action.request_ids[0]] = entry
        return [action]

    def on_trained(self, version: int, groups: list[Group]) -> None:
        super().on_trained(version, groups)
        self.training = False

    # --- admission and training -------------------------------------------------------------
    def in_flight_prompts(self) -> int:
        return sum(self.due.values()) + len(self.restored)

    def _fill(self) -> list[Action]:
        """Admit prompts while (trained + in flight) // B <= version + eta."""
        room = (self.version + self.eta + 1) * self.batch - self.ledger.trained - self.in_flight_prompts()
        return [self._admit(p) for p in self.draw(max(room, 0))]

    def _admit(self, prompt: Prompt) -> Action:
        entry = AdmittedPrompt(prompt, self.version + self.eta, self.group_size)
        self.due[entry.deadline] += 1
        action = self.submit(prompt, entry.group_size)
        self.running.update((rid, entry) for rid in action.request_ids)
        return action

    def _train(self) -> list[Action]:
        if self.training or len(self.ready) < self.batch:
            return []
        taken = earliest(self.ready_due, self.batch)  # the Train's deadlines, counted before any sorting: it may wait
        left = self.due - taken
        owed = 0
        for deadline in sorted(left):  # groups due by `deadline` must fit in the Trains after this one
            owed += left[deadline]
            if owed > (deadline - self.version) * self.batch:
                self.counts["deadline_waits"] += 1
                return []
        take = sorted(self.ready, key=lambda e: e.deadline)[: self.batch]  # stable: finish order kept
        chosen = {id(e) for e in take}
        self.ready = [e for e in self.ready if id(e) not in chosen]
        self.ready_due -= taken
        self.due = left
        self.training = True
        self.ledger.train(len(take))
        for entry in take:
            self._record(entry)
        return [Train([Group(e.prompt, e.samples) for e in take])]

    def _record(self, entry: AdmittedPrompt) -> None:
        """Staleness of each sample: the version it is trained at minus its oldest token's."""
        for s in entry.samples:
            versions = version_counts(s.completion.versions)
            if versions:
                lag = self.version - min(versions)
                self.lag_sum, self.lag_samples = self.lag_sum + lag, self.lag_samples + 1
                self.lag_max = max(self.lag_max, lag)

    # --- metrics and checkpoints ---------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Staleness over every sample trained so far (the bound holds run-wide), and counters."""
        out = super().metrics()
        out.update({"staleness/mean": self.lag_sum / self.lag_samples if self.lag_samples else 0.0,
                    "staleness/max": self.lag_max, "async/in_flight_prompts": self.in_flight_prompts(),
                    "async/buffered_groups": len(self.ready)})
        out.update({f"async/{k}": v for k, v in self.counts.items()})
        return out

    def state_dict(self) -> dict:
        """The open prompts (admitted, not trained or dropped), not their samples.

        Take it once the trainer has applied every Train emitted and `version` is the new one (the
        live controller saves inside its train step). After a restore `start` regenerates every
        open prompt from scratch under the restored weights, so each is still trained exactly once.
        """
        state = super().state_dict()
        generating = {id(e): e.prompt for e in self.running.values()}  # one per prompt, not per request
        open_prompts = self.restored + [e.prompt for e in self.ready] + list(generating.values())
        state["async"] = {"open": [asdict(p) for p in open_prompts], "counts": dict(self.counts),
                          "lag": [self.lag_sum, self.lag_samples, self.lag_max]}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        s = state["async"]
        self.restored = [Prompt(**p) for p in s["open"]]
        self.running, self.ready, self.ready_due, self.due, self.training = {}, [], Counter(), Counter(), False
        self.counts = Counter(s["counts"])
        self.lag_sum, self.lag_samples, self.lag_max = s["lag"]


def earliest(due: Counter, n: int) -> Counter:
    """deadline -> groups among the n earliest due of `due` (deadline -> groups)."""
    taken = Counter()
    for deadline in sorted(due):
        if n <= 0:
            break
        taken[deadline] = min(due[deadline], n)
        n -= taken[deadline]
    return taken
