"""Length selection: does a scheduler train samples of the lengths its policy generates, or a subset chosen by length
(as keeping each prompt's first R finishers of ceil(1.25 R) and aborting the slow ones did)?

`length/selection`: mean trained response length over mean generated response length at the same policy version,
taken prompt by prompt (so that which prompts a step trains, short or long, does not count) and averaged over the
trained samples, for the last step; `length/selection_run` over the run so far. A sample belongs to its prompt and
to the version of its first token. Generated: every sample of that prompt begun under that version, finished or
aborted, at the length it reached; an aborted sample's is a lower bound of its own, so the ratio is an upper bound
and below 1 is length selection for certain. A resumed sample counts once, at its end. A prompt none of whose
samples begun under a version is trained (deferred and regenerated whole later, or dropped whole by dynamic
sampling) leaves them out: its lengths count at the version it is trained at, so deferring whole prompts selects
nothing. Sync trains every sample it generates: exactly 1.0. `length/dropped_share_d1..d10`: the share of generated
samples not trained (aborted, or finished and left out of their group; a deferred prompt's samples once it is trained
again), by decile of the generated lengths, over the run so far.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from rlsys.runs import run_lengths
from rlsys.types import Completion, Group

# A prompt's samples are trained within this many versions of their first token or never (sorted's max_versions and
# async's eta are far below it): older samples still waiting are forgotten, as their prompt was regenerated.
SETTLE_VERSIONS = 32
DECILES = 10

Key = tuple[int, str]  # (version of a sample's first token, its prompt uid)


@dataclass
class Seen:
    """A sample's output as it came back, until it is trained or left out."""
    request_id: str
    length: int
    counts: Counter  # tokens per policy version
    aborted: bool

    def continued_by(self, counts: Counter) -> bool:
        """A resumption of this cut sample: it holds exactly this sample's tokens up to the version of the cut."""
        last = max(self.counts)
        return last < max(counts) and all(counts[v] == n for v, n in self.counts.items()) and \
            all(v > last for v in counts if v not in self.counts)


class LengthSelection:
    def __init__(self):
        self.waiting: dict[Key, list[Seen]] = defaultdict(list)  # samples of prompts not trained (yet)
        # Prompts trained: trained tokens and samples, generated tokens and samples (what comes back later was
        # generated and left out of training, and counts there)
        self.tallies: dict[Key, list[int]] = {}
        self.generated: Counter[int] = Counter()  # over the run: length -> samples generated
        self.dropped: Counter[int] = Counter()  # ... of them, not trained
        self.run = [0.0, 0]  # the run's trained samples weighted by their prompt's ratio, and trained samples
        self.last_step = [0.0, 0]  # the same, of the prompts the last step trained

    def seen(self, completion: Completion, version: int) -> None:
        """A sample came back, finished or aborted (`version`: the scheduler's, for outputs without versions)."""
        if completion.finish_reason == "abort" and not completion.num_tokens:
            return  # never began: nothing was generated
        counts = version_counts(completion.versions) or Counter({version: completion.num_tokens})
        key = (min(counts), completion.prompt_uid)
        if key in self.tallies:  # left out of its prompt's group, trained already
            self._count(completion.num_tokens, trained=False)
            self._retally(key, completion.num_tokens)
            return
        waiting = self.waiting[key]
        cut = [s for s in waiting if s.aborted and s.continued_by(counts)]
        if cut:  # a resumed sample: it replaces the output it continues
            waiting.remove(max(cut, key=lambda s: max(s.counts)))
        waiting.append(Seen(completion.request_id, completion.num_tokens, counts, completion.finish_reason == "abort"))

    def trained(self, groups: list[Group], version: int) -> None:
        """The step boundary: `groups` were trained, and the engines now serve `version`."""
        step: dict[Key, list[int]] = {}
        for group in groups:
            for s in group.samples:
                c = s.completion
                key = (min(version_counts(c.versions), default=version - 1), c.prompt_uid)  # trained at version - 1
                tally = step.setdefault(key, [0, 0, 0, 0])
                tally[0] += c.num_tokens
                tally[1] += 1
                self._count(c.num_tokens, trained=True)
                self.waiting[key] = [w for w in self.waiting.get(key, []) if w.request_id != c.request_id]
        for key, tally in step.items():
            left_out = [w.length for w in self.waiting.pop(key, [])]
            for length in left_out:
                self._count(length, trained=False)
            tally[2], tally[3] = tally[0] + sum(left_out), tally[1] + len(left_out)
        self.tallies.update(step)
        self._drop_earlier_visits(step)
        self.last_step = [sum(weighted(t) for t in step.values()), sum(t[1] for t in step.values())]
        self.run = [self.run[0] + self.last_step[0], self.run[1] + self.last_step[1]]
        old = version - SETTLE_VERSIONS
        self.waiting = defaultdict(list, {k: v for k, v in self.waiting.items() if k[0] >= old and v})
        self.tallies = {k: t for k, t in self.tallies.items() if k[0] >= old}

    def _drop_earlier_visits(self, step: dict[Key, list[int]]) -> None:
        """Samples of a prompt begun under an earlier version than the one it was just trained at (tail's deferred
        prompts, cut and regenerated whole) were generated and never trained: they count in the dropped share by decile,
        not in the ratio, which compares a prompt's trained samples with its samples of the same version."""
        trained_at: dict[str, int] = {}
        for version, uid in step:
            trained_at[uid] = max(version, trained_at.get(uid, version))
        earlier = [k for k in self.waiting if k[0] < trained_at.get(k[1], k[0])]
        for key in earlier:
            for s in self.waiting.pop(key):
                self._count(s.length, trained=False)

    def _retally(self, key: Key, length: int) -> None:
        tally = self.tallies[key]
        before = weighted(tally)
        tally[2] += length
        tally[3] += 1
        self.run[0] += weighted(tally) - before

    def _count(self, length: int, trained: bool) -> None:
        self.generated[length] += 1
        if not trained:
            self.dropped[length] += 1

    def metrics(self) -> dict[str, float]:
        """The last step's ratio, the run's so far, and the run's dropped share by length decile."""
        out = {}
        if self.last_step[1]:
            out["length/selection"] = self.last_step[0] / self.last_step[1]
        if self.run[1]:
            out["length/selection_run"] = self.run[0] / self.run[1]
            out.update({f"length/dropped_share_d{k + 1}": share
                        for k, share in enumerate(dropped_by_decile(self.generated, self.dropped))})
        return out

    def state_dict(self) -> dict:
        """The run's figures; samples in flight at a checkpoint are regenerated after a restore, so none is kept."""
        as_json = lambda counts: {str(k): n for k, n in sorted(counts.items())}  # noqa: E731 (JSON keys are strings)
        return {"generated": as_json(self.generated), "dropped": as_json(self.dropped), "run": self.run,
                "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.generated = Counter({int(k): v for k, v in state["generated"].items()})
        self.dropped = Counter({int(k): v for k, v in state["dropped"].items()})
        self.run, self.last_step = list(state["run"]), list(state["last_step"])


def weighted(tally: list[int]) -> float:
    """A prompt's trained samples times its ratio, mean trained length over mean generated length (1 if all its
    samples were empty)."""
    trained_tokens, trained, generated_tokens, generated = tally
    return trained_tokens * generated / generated_tokens if generated_tokens else trained


def version_counts(versions) -> Counter:
    """{policy version: tokens} of a sample's per-token versions (a list, or Runs as the simulator's are)."""
    counts: Counter = Counter()
    for version, n in run_lengths(versions):
        counts[version] = counts.get(version, 0) + n  # not +=: a missing key's __missing__ is a Python call
    return counts


def dropped_by_decile(generated: dict[int, int], dropped: dict[int, int]) -> list[float]:
    """The share of samples dropped in each tenth of the samples ranked by length; the samples of one length are
    spread over the deciles their ranks fall in, with their dropped share."""
    n = sum(generated.values())
    bounds = [n * k / DECILES for k in range(DECILES + 1)]
    total, cut = [0.0] * DECILES, [0.0] * DECILES
    rank, k0 = 0, 0
    for length in sorted(generated):
        g = generated[length]
        while k0 < DECILES - 1 and bounds[k0 + 1] <= rank:  # the deciles before this rank are done
            k0 += 1
        k = k0
        while k < DECILES and bounds[k] < rank + g:  # the deciles these samples reach
            part = min(rank + g, bounds[k + 1]) - max(rank, bounds[k])
            if part > 0:
                total[k] += part
                cut[k] += dropped.get(length, 0) * part / g
            k += 1
        rank += g
    return [c / t if t else 0.0 for c, t in zip(cut, total)]
