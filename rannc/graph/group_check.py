"""Checks on an ordered grouping of a task graph (the planner's pipeline stages).

A plan splits the tasks into groups numbered in pipeline order, and runs group
0, then group 1, and so on. That is only possible when no data dependency
points backwards, from a later group to an earlier one; the same condition
makes every group convex (no path leaves a group and comes back into it).
`check_ordered_groups` tests it, and `group_dag_edges` gives the graph between
the groups, from which the planner derives the stage-to-stage transfers.

Both use the native `rannc._C` when it is built; the pure Python versions here
(`_check_ordered_groups_py`, `_group_dag_edges_py`) are the reference the tests
compare it against, and the fallback for a tree in which it has not been built.
Both versions raise ValueError on a node id outside the graph, rather than
letting Python's negative indexing silently accept it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)

try:
    from rannc import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only in an unbuilt tree
    _C = None
    log.info("rannc._C is not built; using the Python group checks")


def _check_edges(n: int, edges: Sequence[tuple[int, int]]) -> None:
    """Raise ValueError naming the first edge with a node outside 0..n-1.

    Python would accept a negative index and read the wrong node; the native
    code would read out of bounds. Both reject it the same way instead.
    """
    for k, (a, b) in enumerate(edges):
        if not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"edge {k} ({a}, {b}) has a node outside 0..{n - 1} (n = {n})")


def _check_ordered_groups_py(
    n: int, edges: Sequence[tuple[int, int]], group_of: Sequence[int]
) -> tuple[int, int] | None:
    """The first edge (a, b), in the given order, with group_of[a] > group_of[b], else None.

    Groups run in their numbered order, so the grouping is executable stage
    after stage exactly when no edge points to an earlier group; returning the
    offending edge (not just False) lets the caller say which dependency breaks it.
    The reference for the native `rannc._C.check_ordered_groups`.
    """
    if n < 0:
        raise ValueError(f"the node count must be >= 0, got {n}")
    if len(group_of) != n:
        raise ValueError(f"group_of has {len(group_of)} entries for {n} nodes")
    _check_edges(n, edges)
    for a, b in edges:
        if group_of[a] > group_of[b]:
            return (a, b)
    return None


def _group_dag_edges_py(
    edges: Sequence[tuple[int, int]], group_of: Sequence[int]
) -> list[tuple[int, int]]:
    """The sorted, de-duplicated (group_of[a], group_of[b]) for edges between different groups.

    This is the quotient graph of the grouping: one edge per pair of groups some
    dependency connects. Sorting makes the result deterministic, so plans built
    from it are reproducible. The reference for the native `rannc._C.group_dag_edges`.
    """
    _check_edges(len(group_of), edges)
    return sorted({(group_of[a], group_of[b]) for a, b in edges if group_of[a] != group_of[b]})


def check_ordered_groups(
    n: int, edges: Sequence[tuple[int, int]], group_of: Sequence[int]
) -> tuple[int, int] | None:
    """None if the ordered grouping can run stage after stage, else the first backward edge.

    Uses `rannc._C` when built (large graphs), else `_check_ordered_groups_py`.
    """
    if _C is not None:
        bad = _C.check_ordered_groups(n, list(edges), list(group_of))
        return None if bad is None else (int(bad[0]), int(bad[1]))
    return _check_ordered_groups_py(n, edges, group_of)


def group_dag_edges(
    edges: Sequence[tuple[int, int]], group_of: Sequence[int]
) -> list[tuple[int, int]]:
    """The edges between groups, sorted and without repeats.

    Uses `rannc._C` when built (large graphs), else `_group_dag_edges_py`.
    """
    if _C is not None:
        return [(int(a), int(b)) for a, b in _C.group_dag_edges(list(edges), list(group_of))]
    return _group_dag_edges_py(edges, group_of)
