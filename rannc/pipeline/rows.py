"""Which global batch rows every rank owns, every microbatch holds and every replica computes.

Pure arithmetic, the same on every rank, so that senders and receivers agree on
every transfer without asking each other. Rows are *samples* of the global
batch (the concatenation of the ranks' local batches in rank order); a value
with `batch_scale` k holds k tensor rows per sample.

Index conventions: r ranks, m microbatches, j a stage's replicas.
A range is (start, stop) in global sample rows, stop exclusive.
"""

from __future__ import annotations

from collections.abc import Sequence

Range = tuple[int, int]


def split_by_shares(start: int, stop: int, shares: Sequence[float]) -> list[Range]:
    """Contiguous ranges covering [start, stop), sized by `shares` (largest remainder)."""
    n = stop - start
    total = sum(shares)
    exact = [n * s / total for s in shares]
    sizes = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (sizes[i] - exact[i], i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    out, at = [], start
    for sz in sizes:
        out.append((at, at + sz))
        at += sz
    return out


def microbatch_ranges(n_rows: int, microbatches: int) -> list[Range]:
    """The global batch split into `microbatches` contiguous, near-equal ranges."""
    return split_by_shares(0, n_rows, [1.0] * microbatches)


def rank_ranges(local_sizes: Sequence[int]) -> list[Range]:
    """The global rows each rank's local batch holds."""
    out, at = [], 0
    for n in local_sizes:
        out.append((at, at + n))
        at += n
    return out


def intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class RowLayout:
    """Rows per (microbatch, replica) for every stage, for one call's local batch sizes."""

    def __init__(self, local_sizes: Sequence[int], microbatches: int,
                 stage_shares: Sequence[Sequence[float]]) -> None:
        self.local_sizes = list(local_sizes)
        self.n_rows = sum(local_sizes)
        if self.n_rows < 1:
            raise ValueError("the global batch is empty: every rank passed 0 rows")
        # Fewer rows than microbatches (a small last batch) leaves some microbatches empty;
        # every rank skips them alike.
        self.owned = rank_ranges(local_sizes)
        self.micro = microbatch_ranges(self.n_rows, microbatches)
        # rows[s][m][j]: the rows replica j of stage s computes in microbatch m
        self.rows = [[split_by_shares(a, b, shares) for (a, b) in self.micro] for shares in stage_shares]

    def every_replica_computes(self) -> bool:
        """Whether every replica of every stage computes rows in some microbatch: then every
        replica runs the same backward graph and gets a gradient for the same parameters."""
        return all(any(per[j][0] < per[j][1] for per in stage) for stage in self.rows
                   for j in range(len(stage[0])))
