"""The native graph algorithms (`rannc._C`) against their Python references.

The extension must be built (`python setup.py build_ext --inplace`; CI does
so): an unbuilt tree fails here rather than skipping, so a broken build cannot
pass unnoticed behind the Python fallback.
"""

from __future__ import annotations

import random

import pytest

from rannc.graph import group_check
from rannc.graph import task_graph as ref

pytestmark = pytest.mark.layer("pure")

try:
    from rannc import _C  # type: ignore[attr-defined]
except ImportError as e:  # a failure, not a skip: see the module docstring
    raise ImportError(
        "rannc._C is not built; run `python setup.py build_ext --inplace` first"
    ) from e

Edges = list[tuple[int, int]]

N_RANDOM = 300


def random_dag(rng: random.Random, n: int, n_edges: int | None = None) -> tuple[Edges, list[int]]:
    """A DAG on 0..n-1 with nontrivial labels, and a topological order of it.

    Edges i < j are drawn with replacement (so there are repeats), then the
    labels are permuted so that index order is no longer a topological order.
    """
    if n_edges is None:
        n_edges = rng.randint(0, 4 * n)
    raw: Edges = []
    if n >= 2:
        for _ in range(n_edges):
            i, j = sorted(rng.sample(range(n), 2))
            raw.append((i, j))
    perm = list(range(n))
    rng.shuffle(perm)
    edges = [(perm[i], perm[j]) for i, j in raw]
    return edges, perm  # perm lists the new labels in a topological order


def is_topological(n: int, edges: Edges, order: list[int]) -> bool:
    pos = {v: k for k, v in enumerate(order)}
    return sorted(order) == list(range(n)) and all(pos[a] < pos[b] for a, b in edges)


def ordered_groups(rng: random.Random, topo: list[int]) -> list[int]:
    """Cut a topological order into contiguous runs: a valid ordered grouping."""
    group_of = [0] * len(topo)
    g = 0
    for v in topo:
        if rng.random() < 0.1:
            g += 1
        group_of[v] = g
    return group_of


def cases() -> list[tuple[int, Edges, list[int], random.Random]]:
    rng = random.Random(20240601)
    out = []
    for _ in range(N_RANDOM):
        n = rng.randint(1, 200)
        edges, topo = random_dag(rng, n)
        out.append((n, edges, topo, random.Random(rng.random())))
    return out


CASES = cases()


# -- topological_order ----------------------------------------------------------


def test_topological_order_matches_reference() -> None:
    for n, edges, _, _ in CASES:
        got = _C.topological_order(n, edges)
        assert got == ref.topological_order(n, edges)
        assert is_topological(n, edges, got)


def test_topological_order_keeps_an_ordered_graph() -> None:
    rng = random.Random(1)
    edges = [(i, j) for i in range(50) for j in range(i + 1, 50) if rng.random() < 0.2]
    assert _C.topological_order(50, edges) == list(range(50))


def test_topological_order_smallest_ready_first() -> None:
    assert _C.topological_order(4, [(3, 0), (2, 1)]) == [2, 1, 3, 0]
    assert _C.topological_order(3, [(2, 0), (1, 0)]) == [1, 2, 0]


def test_topological_order_empty_and_isolated() -> None:
    assert _C.topological_order(0, []) == []
    assert _C.topological_order(5, []) == [0, 1, 2, 3, 4]
    assert _C.topological_order(5, [(4, 1)]) == [0, 2, 3, 4, 1]


def test_topological_order_cycles() -> None:
    rng = random.Random(7)
    for _ in range(100):
        n = rng.randint(2, 200)
        edges, _ = random_dag(rng, n, n_edges=rng.randint(1, 3 * n))
        a, b = rng.choice(edges)
        edges.insert(rng.randrange(len(edges) + 1), (b, a))
        with pytest.raises(ValueError, match="the graph has a cycle") as native:
            _C.topological_order(n, edges)
        with pytest.raises(ValueError) as python:
            ref.topological_order(n, edges)
        assert str(native.value) == str(python.value)
    with pytest.raises(ValueError, match="1 of 1 nodes"):
        _C.topological_order(1, [(0, 0)])
    with pytest.raises(ValueError, match="3 of 4 nodes are on or after one"):
        _C.topological_order(4, [(1, 2), (2, 1), (2, 3)])


@pytest.mark.parametrize("bad", [(0, 5), (5, 0), (-1, 0), (0, -1), (3, 3)])
def test_topological_order_bad_edge(bad: tuple[int, int]) -> None:
    with pytest.raises((ValueError, IndexError), match=rf"\({bad[0]}, {bad[1]}\)"):
        _C.topological_order(3, [(0, 1), bad])


def test_negative_node_count() -> None:
    with pytest.raises(ValueError):
        _C.topological_order(-1, [])
    with pytest.raises(ValueError):
        _C.forward_reachable(-1, [], [])


# -- forward_reachable -----------------------------------------------------------


def test_forward_reachable_matches_reference() -> None:
    for n, edges, _, rng in CASES:
        for k in (0, 1, 3):
            sources = [rng.randrange(n) for _ in range(k)]
            got = _C.forward_reachable(n, edges, sources)
            assert got == ref.forward_reachable(n, edges, sources)
            assert all(got[s] for s in sources)


def test_forward_reachable_small() -> None:
    assert _C.forward_reachable(0, [], []) == []
    assert _C.forward_reachable(4, [], [2]) == [False, False, True, False]
    assert _C.forward_reachable(4, [(0, 1), (1, 2), (3, 0)], [0, 0]) == [True, True, True, False]
    # works on a graph with a cycle too
    assert _C.forward_reachable(3, [(0, 1), (1, 0), (1, 2)], [1]) == [True, True, True]


def test_forward_reachable_bad_ids() -> None:
    with pytest.raises((ValueError, IndexError), match=r"\(1, 9\)"):
        _C.forward_reachable(3, [(1, 9)], [0])
    with pytest.raises((ValueError, IndexError)):
        _C.forward_reachable(3, [], [3])
    with pytest.raises((ValueError, IndexError)):
        _C.forward_reachable(3, [], [-1])


# -- check_ordered_groups ---------------------------------------------------------


def test_check_ordered_groups_matches_reference() -> None:
    saw_bad = saw_ok = 0
    for n, edges, topo, rng in CASES:
        good = ordered_groups(rng, topo)
        assert _C.check_ordered_groups(n, edges, good) is None
        assert group_check._check_ordered_groups_py(n, edges, good) is None
        for _ in range(3):
            groups = [rng.randrange(4) for _ in range(n)]
            got = _C.check_ordered_groups(n, edges, groups)
            assert got == group_check._check_ordered_groups_py(n, edges, groups)
            assert got == group_check.check_ordered_groups(n, edges, groups)
            if got is None:
                saw_ok += 1
            else:
                saw_bad += 1
                a, b = got
                assert groups[a] > groups[b]
                # the first violating edge in the given order
                first = next(k for k, (x, y) in enumerate(edges) if groups[x] > groups[y])
                assert edges[first] == got
    assert saw_bad > 100 and saw_ok > 10


def test_check_ordered_groups_small() -> None:
    assert _C.check_ordered_groups(0, [], []) is None
    assert _C.check_ordered_groups(3, [], [2, 1, 0]) is None
    assert _C.check_ordered_groups(3, [(0, 1), (1, 2)], [0, 0, 1]) is None
    assert _C.check_ordered_groups(3, [(0, 1), (2, 1), (1, 0)], [0, 1, 2]) == (2, 1)
    # a non-convex group: 0 -> 1 -> 2 with 0 and 2 in group 0, 1 in group 1
    assert _C.check_ordered_groups(3, [(0, 1), (1, 2)], [0, 1, 0]) == (1, 2)


def test_check_ordered_groups_bad_input() -> None:
    for f in (_C.check_ordered_groups, group_check._check_ordered_groups_py):
        with pytest.raises(ValueError, match="group_of has 2 entries for 3 nodes"):
            f(3, [], [0, 0])
        with pytest.raises((ValueError, IndexError), match=r"\(0, 3\)"):
            f(3, [(0, 3)], [0, 0, 0])
        with pytest.raises((ValueError, IndexError), match=r"\(-1, 0\)"):
            f(3, [(-1, 0)], [0, 0, 0])


# -- group_dag_edges -----------------------------------------------------------------


def test_group_dag_edges_matches_reference() -> None:
    for n, edges, topo, rng in CASES:
        for groups in (ordered_groups(rng, topo), [rng.randrange(5) for _ in range(n)]):
            got = _C.group_dag_edges(edges, groups)
            expected = group_check._group_dag_edges_py(edges, groups)
            assert got == expected
            assert got == group_check.group_dag_edges(edges, groups)
            assert got == sorted(set(got))
            assert all(a != b for a, b in got)


def test_group_dag_edges_small() -> None:
    assert _C.group_dag_edges([], []) == []
    assert _C.group_dag_edges([], [0, 1, 2]) == []
    edges = [(0, 2), (1, 2), (0, 1), (2, 3), (1, 3), (3, 0)]
    assert _C.group_dag_edges(edges, [5, 5, 1, 7]) == [(1, 7), (5, 1), (5, 7), (7, 5)]


def test_group_dag_edges_bad_input() -> None:
    for f in (_C.group_dag_edges, group_check._group_dag_edges_py):
        with pytest.raises((ValueError, IndexError), match=r"\(0, 2\)"):
            f([(0, 1), (0, 2)], [0, 1])


def test_group_check_python_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_check, "_C", None)
    assert group_check.check_ordered_groups(3, [(0, 1), (2, 1)], [0, 1, 2]) == (2, 1)
    assert group_check.group_dag_edges([(0, 1), (2, 1), (0, 2)], [0, 1, 1]) == [(0, 1)]


# -- a large graph ------------------------------------------------------------------


def test_large_graph_agrees() -> None:
    rng = random.Random(99)
    n = 50_000
    edges, topo = random_dag(rng, n, n_edges=500_000)
    assert len(edges) == 500_000

    order = _C.topological_order(n, edges)
    assert order == ref.topological_order(n, edges)
    assert is_topological(n, edges, order)

    sources = [rng.randrange(n) for _ in range(5)]
    assert _C.forward_reachable(n, edges, sources) == ref.forward_reachable(n, edges, sources)

    good = ordered_groups(rng, topo)
    assert _C.check_ordered_groups(n, edges, good) is None
    assert group_check._check_ordered_groups_py(n, edges, good) is None
    bad = [rng.randrange(16) for _ in range(n)]
    assert _C.check_ordered_groups(n, edges, bad) == group_check._check_ordered_groups_py(
        n, edges, bad
    )
    assert _C.group_dag_edges(edges, bad) == group_check._group_dag_edges_py(edges, bad)
    assert _C.group_dag_edges(edges, good) == group_check._group_dag_edges_py(edges, good)

    # a back edge makes it cyclic
    a, b = edges[0]
    with pytest.raises(ValueError, match="the graph has a cycle"):
        _C.topological_order(n, [*edges, (b, a)])
