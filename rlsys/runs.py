"""A read-only run-length sequence, so simulated completions report lengths without token lists."""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, groupby


class Runs(Sequence):
    """`Runs([(value, count), ...])` behaves like the list with each value repeated count times."""
    __slots__ = ("runs", "_len", "_ends")

    def __init__(self, runs: list[tuple[object, int]]):
        if len(runs) == 1:  # the common case, kept cheap
            self.runs, self._len = (runs if runs[0][1] > 0 else []), max(runs[0][1], 0)
        else:
            self.runs = [(v, c) for v, c in runs if c > 0]
            self._len = sum(c for _, c in self.runs)
        self._ends = None  # built on first indexing: most users only ask for the length

    @classmethod
    def repeat(cls, value, n: int) -> "Runs":
        """`value` n times. Shared, as they are read-only: simulations ask for millions of them."""
        key = (value, n, type(value))  # 0 == 0.0, yet token ids and log-probs differ in type
        out = _REPEATS.get(key)
        if out is None:
            out = _REPEATS[key] = cls([(value, n)])
        return out

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("Runs index out of range")
        if self._ends is None:
            self._ends = list(accumulate(c for _, c in self.runs))
        return self.runs[bisect_right(self._ends, i)][0]

    def __iter__(self):
        for value, count in self.runs:
            for _ in range(count):
                yield value

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Runs)) else NotImplemented

    def __repr__(self) -> str:
        return f"Runs({self.runs})"


_REPEATS: dict[tuple, Runs] = {}


def run_lengths(values) -> list[tuple[object, int]]:
    """The (value, count) runs of a sequence: read off a Runs (iterating one costs a step per token,
    millions for resumed long samples), counted on anything else."""
    if isinstance(values, Runs):
        return list(values.runs)
    return [(v, sum(1 for _ in run)) for v, run in groupby(values)]
