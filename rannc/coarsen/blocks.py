"""Phase 2 (paper III-B): group atomic components into k blocks.

The stage search of phase 3 is exponential in what it combines, so the ~1,200
to ~15,000 atomic components of a large model are first grouped into k blocks
whose computation times are balanced and which send few bytes to each other.
This is the paper's k-way multilevel partitioning, made deterministic:

1. Coarsening, level by level: visit the groups in ascending computation time
   (ties: smallest member); each group not yet merged at this level joins the
   adjacent unmerged group that minimises the time of the union (ties:
   smallest member), provided the union fits `mem_limit` and the grouping stays
   valid. Stop merging within a level once k groups remain; stop when a level
   merges nothing.
2. Uncoarsening, from the coarsest level down: for each merged pair (v, w), in
   the order it was merged, consider moving v, then w, into each group t
   adjacent to v ∪ w one level up. Keep the moves that send strictly fewer bytes
   between that level's groups and, when they change the final groups, strictly
   fewer between those too (the paper measures only the first; a tie on the
   final groups would reshuffle balanced blocks for nothing); apply the
   best (largest saving; ties: v before w, then t's smallest member) that keeps
   every coarser level it changes valid and within memory. The move changes
   every coarser level where x and t are still apart.
3. Compaction, while more than k groups remain: list the groups in topological
   order; the group with the smallest time (ties: smallest member) that can
   merge with a neighbour in the list does so, with its cheaper neighbour (ties:
   the left one) if memory allows, else with the other.

Finally blocks are numbered in topological order, the ready block with the
smallest member first. A grouping is *valid* when the graph between its groups
has no cycle: every group is then convex (no path leaves it and comes back)
and the blocks can run one after another. Convexity of each group alone is not
enough, see `rannc.coarsen.reference`.

Communication: a value goes once to every distinct group, other than its
producer's, that holds one of its consumers, taking bytes / bandwidth seconds.
Every decision compares such times on one link, so the bandwidth cancels out
and the grouping does not depend on it.

`form_blocks` runs the native `rannc._C.form_blocks`; `form_blocks_reference`
runs the plain Python statement of the same rules in `rannc.coarsen.reference`,
which the tests require to give the identical result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rannc.coarsen import reference as _ref

try:
    from rannc import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only in an unbuilt tree
    _C = None


@dataclass(frozen=True, slots=True)
class CoarsenProblem:
    """What block formation needs to know about the atomic components."""

    n: int
    """Atomic components are 0..n-1; index order is a topological order."""
    values: Sequence[tuple[int, Sequence[int], float]]
    """(producer, consumers, bytes) per data value; every consumer is > its producer."""
    time: Sequence[float]
    """Computation time (forward + backward) of each component, >= 0."""
    memory: Sequence[float]
    """Memory of each component, >= 0; a group needs the sum of its members'."""
    mem_limit: float
    """No group may need more (a component that alone needs more stays on its own)."""
    k: int
    """Desired number of blocks, >= 1."""
    bandwidth: float = 1.0
    """Bytes per second; a value's communication time is bytes / bandwidth."""

    def __post_init__(self) -> None:
        _validate(self)


def _bad_number(x: float) -> bool:
    return not (math.isfinite(x) and x >= 0)


def _validate(p: CoarsenProblem) -> None:
    if p.n < 0:
        raise ValueError(f"n = {p.n}; the number of atomic components must be >= 0")
    for name, seq in (("time", p.time), ("memory", p.memory)):
        if len(seq) != p.n:
            raise ValueError(
                f"{name} has {len(seq)} entries for n = {p.n} atomic components; "
                f"give one {name} per component"
            )
        for c, x in enumerate(seq):
            if _bad_number(x):
                raise ValueError(f"{name}[{c}] = {x!r}; it must be finite and >= 0")
    if p.k < 1:
        raise ValueError(f"k = {p.k}; the number of blocks must be >= 1")
    if math.isnan(p.mem_limit) or p.mem_limit < 0:
        raise ValueError(f"mem_limit = {p.mem_limit!r}; it must be >= 0 (math.inf for no limit)")
    if not (math.isfinite(p.bandwidth) and p.bandwidth > 0):
        raise ValueError(f"bandwidth = {p.bandwidth!r}; it must be a finite number of bytes/s > 0")
    for i, (prod, consumers, nbytes) in enumerate(p.values):
        if not 0 <= prod < p.n:
            raise ValueError(f"value {i} has producer {prod}, outside the components 0..{p.n - 1}")
        for c in consumers:
            if not prod < c < p.n:
                raise ValueError(
                    f"value {i} (producer {prod}) has consumer {c}, which is not a component "
                    f"after its producer; number the components in a topological order "
                    f"(every consumer > its producer, all < n = {p.n})"
                )
        if _bad_number(nbytes):
            raise ValueError(f"value {i} has bytes = {nbytes!r}; it must be finite and >= 0")


def _normalised(p: CoarsenProblem) -> _ref.Problem:
    """The input as plain floats and tuples, exactly as the native code receives it."""
    return _ref.Problem(
        n=p.n,
        values=[(int(prod), tuple(int(c) for c in cs), float(b)) for prod, cs, b in p.values],
        time=[float(t) for t in p.time],
        memory=[float(m) for m in p.memory],
        mem_limit=float(p.mem_limit),
        k=int(p.k),
    )


def _form_blocks(p: CoarsenProblem, *, uncoarsen: bool) -> list[int]:
    if _C is None:
        raise RuntimeError(
            "rannc._C is not built; run `python setup.py build_ext --inplace` "
            "(or use form_blocks_reference, which is much slower)"
        )
    q = _normalised(p)
    return list(_C.form_blocks(q.n, q.values, q.time, q.memory, q.mem_limit, q.k, uncoarsen))


def _form_blocks_reference(p: CoarsenProblem, *, uncoarsen: bool) -> list[int]:
    return _ref.form_blocks(_normalised(p), uncoarsen_step=uncoarsen)


def form_blocks(p: CoarsenProblem) -> list[int]:
    """block_of[c] for each component (native).

    Blocks are numbered 0..m-1 in a topological order of the block graph, so any
    contiguous range of block numbers is a convex set. m == k unless memory (or,
    with m > k groups left, the neighbour-only compaction) prevents merging
    further; m == n when n < k.
    """
    return _form_blocks(p, uncoarsen=True)


def form_blocks_reference(p: CoarsenProblem) -> list[int]:
    """The same algorithm written plainly in Python; gives output identical to form_blocks."""
    return _form_blocks_reference(p, uncoarsen=True)


# -- checks used by tests and callers ----------------------------------------------


def is_convex(n: int, edges: Sequence[tuple[int, int]], members: Sequence[int]) -> bool:
    """Whether no path between two members of `members` passes through a non-member.

    Plain reachability: the non-members reachable from a member must not reach a member.
    """
    inside = set(members)
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
    # non-members reachable from the group
    out_reach: set[int] = set()
    stack = [b for a in inside for b in succ[a] if b not in inside]
    while stack:
        c = stack.pop()
        if c in out_reach:
            continue
        out_reach.add(c)
        for d in succ[c]:
            if d in inside:
                return False
            stack.append(d)
    return True


def block_comm_bytes(p: CoarsenProblem, block_of: Sequence[int]) -> float:
    """Bytes sent between blocks: each value once to every other block holding a consumer."""
    total = 0.0
    for prod, consumers, nbytes in p.values:
        receivers = {block_of[c] for c in consumers} - {block_of[prod]}
        total += len(receivers) * float(nbytes)
    return total
