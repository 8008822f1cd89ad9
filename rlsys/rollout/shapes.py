"""The built-in engine's static decode shapes (graph_step.py): a step runs a batch bucket of rows over a key-length
bucket of positions. Plain Python, so the cost model (rlsys/costs.py) charges the padded step by the same rule.
"""
from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

# Bucket steps: batches of 1, 2, 4, 8, 16, 24, ...; keys of 1, 2, 4, ..., 128, 256, 512, 768, ... Each shape a run
# meets is captured once per wake; coarse key buckets keep that to a few dozen at 4k positions.
BATCH_FINE, KEYS_FINE = 8, 256


@lru_cache(maxsize=64)
def buckets(limit: int, fine: int) -> tuple[int, ...]:
    """Powers of two below `fine`, then multiples of `fine`, up to `limit` (always included): few shapes to
    capture, and little padding where padding costs most."""
    small = [1 << k for k in range(fine.bit_length()) if 1 << k < min(fine, limit)]
    return tuple(small + [n for n in range(fine, limit, fine)] + [limit])


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size that holds n."""
    return sizes[bisect_left(sizes, n)]
