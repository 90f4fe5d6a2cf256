"""Whale's hardware-aware balancing: how a stage's replicas on different devices split rows.

Each replica's share of a microbatch's rows is proportional to its device's speed, so they
finish together; a replica whose device cannot hold that many rows' activations gets what fits
and the rest is spread over the others by speed (water-filling), as Whale's memory-constrained
balancing does (paper section 3.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rannc.errors import RaNNCError


def whale_shares(rows: float, speeds: Sequence[float], caps: Sequence[float]) -> list[float]:
    """Rows per replica summing to `rows`: proportional to `speeds`, none above its `caps`
    (rows its memory holds). Raises when the caps together hold fewer than `rows`."""
    n = len(speeds)
    if n != len(caps) or n == 0 or min(speeds) <= 0:
        raise ValueError(f"need one positive speed and one cap per replica, got {speeds}, {caps}")
    if sum(max(c, 0.0) for c in caps) < rows * (1 - 1e-12):
        raise RaNNCError(f"the replicas hold {sum(caps):.1f} rows of activations together but a "
                         f"microbatch has {rows}; use more devices or fewer rows per microbatch")
    out = [0.0] * n
    free = set(range(n))
    left = float(rows)
    while free:
        total = sum(speeds[j] for j in free)
        want = {j: left * speeds[j] / total for j in free}
        over = [j for j in free if want[j] > caps[j]]
        if not over:
            for j in free:
                out[j] = want[j]
            break
        for j in over:  # pinned at what fits; the others share the rest
            out[j] = max(caps[j], 0.0)
            left -= out[j]
            free.discard(j)
    return out


def finish_time(shares: Sequence[float], speeds: Sequence[float]) -> float:
    """When the slowest replica finishes, in units of (rows / speed)."""
    return max((x / v for x, v in zip(shares, speeds, strict=True) if x > 0), default=0.0) or math.inf


__all__ = ["finish_time", "whale_shares"]
