"""Rollout metrics as defined in DESIGN.md ("Metrics"), computed from completions alone."""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

from rlsys.types import Completion


def is_straggler(lengths: Sequence[int], kappa: float) -> bool:
    """A group's slowest sample takes more than kappa times the group's median.

    Time is measured in generated tokens: a sample's decode time is proportional to its length
    under continuous batching, and lengths are free of machine noise.
    """
    if len(lengths) < 2:
        return False
    return max(lengths) > kappa * max(statistics.median(lengths), 1)


def straggler_rate(groups_lengths: Iterable[Sequence[int]], kappa: float) -> float:
    flags = [is_straggler(lengths, kappa) for lengths in groups_lengths]
    return sum(flags) / len(flags) if flags else 0.0


def bubble_ratio(completions: Sequence[Completion], capacity: int, start: float, end: float) -> float:
    """1 - occupied slot-seconds / available slot-seconds over the rollout window [start, end].

    `capacity` is the total number of slots over all engines. This is DESIGN.md's decode-step
    definition measured in time, so idle engines waiting for others count as bubble too.
    """
    window = end - start
    if window <= 0 or capacity <= 0:
        return 0.0
    busy = sum(max(0.0, min(c.end_time, end) - max(c.start_time, start)) for c in completions)
    return max(0.0, 1.0 - busy / (capacity * window))


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
