"""Rollout metrics as defined in docs/design.md ("Metrics"): straggler events from lengths, the bubble ratio from
slot occupancy (the live engines and the simulator record it; completions give it where all are known)."""
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


def idle_share(occupied_slot_s: float, available_slot_s: float) -> float:
    """The bubble ratio: 1 - occupied slot-seconds / available slot-seconds (docs/design.md's decode-step
    definition measured in time, so idle engines waiting for others count as bubble too)."""
    return max(0.0, 1.0 - occupied_slot_s / available_slot_s) if available_slot_s > 0 else 0.0


def bubble_ratio(completions: Sequence[Completion], capacity: int, start: float, end: float) -> float:
    """The bubble ratio over [start, end] of engines with `capacity` slots in all, from the completions
    that ran in it (exact only when every request of the window has completed)."""
    busy = sum(max(0.0, min(c.end_time, end) - max(c.start_time, start)) for c in completions)
    return idle_share(busy, capacity * (end - start)) if capacity > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
