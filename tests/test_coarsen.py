"""Block formation (rannc.coarsen.blocks, paper III-B): native against the reference, and
the properties every grouping must have.

The extension must be built (`python setup.py build_ext --inplace`): an unbuilt
tree fails here, as in test_native.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

import pytest
from coarsen_graphs import bert_like, random_problem

from rannc.coarsen import reference
from rannc.coarsen.blocks import (
    CoarsenProblem,
    _form_blocks,
    _form_blocks_reference,
    _normalised,
    block_comm_bytes,
    form_blocks,
    form_blocks_reference,
    is_convex,
)

pytestmark = pytest.mark.layer("pure")

try:
    from rannc import _C  # type: ignore[attr-defined]
except ImportError as e:  # a failure, not a skip: see the module docstring
    raise ImportError("rannc._C is not built; run `python setup.py build_ext --inplace` first") from e

N_RANDOM = 250


def edges_of(p: CoarsenProblem) -> list[tuple[int, int]]:
    return [(prod, c) for prod, consumers, _ in p.values for c in consumers]


def reachable_from(n: int, edges: Sequence[tuple[int, int]]) -> list[set[int]]:
    """reach[c]: the components reachable from c by a path of length >= 1 (plain closure;
    index order is topological, so a reverse sweep settles successors first)."""
    succ: list[set[int]] = [set() for _ in range(n)]
    for a, b in edges:
        succ[a].add(b)
    reach: list[set[int]] = [set() for _ in range(n)]
    for c in reversed(range(n)):
        for d in succ[c]:
            reach[c] |= {d} | reach[d]
    return reach


def convex_by_closure(reach: list[set[int]], members: set[int]) -> bool:
    """No non-member lies on a path between two members."""
    for a in members:
        for x in reach[a] - members:
            if reach[x] & members:
                return False
    return True


def check_blocks(p: CoarsenProblem, block_of: list[int]) -> None:
    """Everything a grouping from form_blocks must satisfy."""
    assert len(block_of) == p.n
    m = max(block_of) + 1 if p.n else 0
    blocks: list[set[int]] = [set() for _ in range(m)]
    for c, b in enumerate(block_of):
        blocks[b].add(c)
    assert all(blocks), f"empty block numbers in {block_of}"
    edges = edges_of(p)
    # numbered in a topological order: no value flows to an earlier block
    assert all(block_of[a] <= block_of[b] for a, b in edges)
    reach = reachable_from(p.n, edges)
    for members in blocks:
        assert convex_by_closure(reach, members)
        if len(members) > 1:
            assert math.fsum(p.memory[c] for c in members) <= p.mem_limit * (1 + 1e-12)
    if p.mem_limit == math.inf:  # k is always reachable: compaction can merge any neighbours
        assert m == min(p.k, p.n)


def random_cases() -> list[CoarsenProblem]:
    rng = random.Random(20240602)
    return [random_problem(rng, rng.randint(1, 40)) for _ in range(N_RANDOM)]


CASES = random_cases()


# -- native against the reference --------------------------------------------------


def test_native_matches_reference_and_blocks_are_valid() -> None:
    for p in CASES:
        got = form_blocks(p)
        assert got == form_blocks_reference(p), p
        check_blocks(p, got)


def test_native_matches_reference_without_uncoarsening() -> None:
    for p in CASES[:100]:
        got = _form_blocks(p, uncoarsen=False)
        assert got == _form_blocks_reference(p, uncoarsen=False), p
        check_blocks(p, got)


def test_cases_cover_the_interesting_regimes() -> None:
    """The random cases reach k, fall short of it for memory, and exceed n."""
    reached = memory_bound = k_above_n = 0
    for p in CASES:
        m = max(form_blocks(p)) + 1
        reached += m == p.k
        memory_bound += m > p.k and p.k < p.n
        k_above_n += p.k > p.n
    assert reached > 50 and memory_bound > 10 and k_above_n > 5


def test_bert_like_matches_reference() -> None:
    p = bert_like(2)
    assert p.n > 140
    for k in (1, 3, 8, 40):
        q = dataclasses.replace(p, k=k)
        assert form_blocks(q) == form_blocks_reference(q)
    q = dataclasses.replace(p, k=8, mem_limit=0.25 * sum(p.memory))
    got = form_blocks(q)
    assert got == form_blocks_reference(q)
    check_blocks(q, got)


# -- what each step does -------------------------------------------------------------


def test_uncoarsening_moves_a_boundary_off_a_heavy_value() -> None:
    """0 -> 1 -> 2 -> 3 with 10 bytes on 1 -> 2. Coarsening pairs by time alone, {0, 1}
    and {2, 3}, cutting the heavy value; uncoarsening moves 1 over and cuts 0 -> 1."""
    p = CoarsenProblem(4, [(0, [1], 1.0), (1, [2], 10.0), (2, [3], 1.0)], [1.0] * 4, [1.0] * 4, math.inf, 2)
    coarse = _form_blocks(p, uncoarsen=False)
    refined = form_blocks(p)
    assert coarse == [0, 0, 1, 1] and block_comm_bytes(p, coarse) == 10.0
    assert refined == [0, 1, 1, 1] and block_comm_bytes(p, refined) == 1.0
    assert form_blocks_reference(p) == refined


def test_uncoarsening_never_sends_more_when_coarsening_reaches_k() -> None:
    """Each move sends no more bytes between the final groups, so without compaction
    the result can only improve; on random graphs it often strictly does."""
    strictly = 0
    for p in CASES:
        coarsest = reference.coarsen(_normalised(p)).levels[-1]
        if len(set(coarsest)) > p.k:
            continue  # compaction runs on different groups in the two runs
        with_moves = block_comm_bytes(p, form_blocks(p))
        without = block_comm_bytes(p, _form_blocks(p, uncoarsen=False))
        assert with_moves <= without + 1e-9
        strictly += with_moves < without - 1e-9
    assert strictly >= 20


def block_times(p: CoarsenProblem, block_of: list[int]) -> list[float]:
    out = [0.0] * (max(block_of) + 1)
    for c, b in enumerate(block_of):
        out[b] += p.time[c]
    return out


def test_bert_like_blocks_are_balanced() -> None:
    """Components are small next to total / k, so blocks come out within 2x of it."""
    p = bert_like(16, k=8)
    assert p.n > 900
    block_of = form_blocks(p)
    check_blocks(p, block_of)
    assert max(block_times(p, block_of)) <= 2 * sum(p.time) / 8


def test_bert_like_uncoarsening_cuts_bytes_not_balance() -> None:
    """Coarsening alone puts each boundary where two activations cross (inside a layer
    norm); uncoarsening moves it to where one does, about halving the bytes between
    blocks at the same balance."""
    p = bert_like(16, k=8)
    coarse, refined = _form_blocks(p, uncoarsen=False), form_blocks(p)
    assert block_comm_bytes(p, refined) < 0.75 * block_comm_bytes(p, coarse)
    assert max(block_times(p, refined)) <= 1.05 * max(block_times(p, coarse))


def test_merging_convex_groups_can_still_make_a_cycle() -> None:
    """0, 1 -> 2, 3 (all four edges): {0, 2} and {1, 3} are each convex, yet 0 -> 3 and
    1 -> 2 make each need the other first. Times make (0, 2) and (1, 3) the cheapest
    pairs; the second merge must be refused."""
    edges = [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert is_convex(4, edges, [0, 2]) and is_convex(4, edges, [1, 3])
    p = CoarsenProblem(4, [(0, [2, 3], 1.0), (1, [2, 3], 1.0)], [1.0, 2.0, 1.0, 2.0], [1.0] * 4, math.inf, 2)
    # level 1: {0, 2}, {1}, {3}; level 2: {0, 2} takes {1} (equal times, smaller member)
    assert _form_blocks(p, uncoarsen=False) == [0, 0, 0, 1]
    # uncoarsening then moves {0, 2} over to 3: value 0 stays inside, one value crosses
    block_of = form_blocks(p)
    assert block_of == form_blocks_reference(p) == [1, 0, 1, 1]
    check_blocks(p, block_of)


def test_compaction_merges_neighbours_until_k() -> None:
    """Isolated components have no adjacent group, so only compaction can merge them:
    the group with the smallest time joins its cheaper neighbour in the order."""
    p = CoarsenProblem(4, [], [1.0, 5.0, 2.0, 3.0], [1.0] * 4, math.inf, 3)
    assert form_blocks(p) == form_blocks_reference(p) == [0, 0, 1, 2]  # 0 has one neighbour
    p = dataclasses.replace(p, k=2)
    assert form_blocks(p) == form_blocks_reference(p) == [0, 0, 1, 1]  # then 2 takes 3 (3 < 6)
    # memory forbids 2 + 3, so 2 takes its dearer neighbour instead
    p = dataclasses.replace(p, memory=[1.0, 1.0, 1.0, 5.0], mem_limit=4.0)
    assert form_blocks(p) == form_blocks_reference(p) == [0, 0, 0, 1]


def test_memory_limit() -> None:
    # a component above the limit stays alone; the rest pair up within it
    p = CoarsenProblem(
        5, [(c, [c + 1], 1.0) for c in range(4)], [1.0] * 5, [1.0, 1.0, 9.0, 1.0, 1.0], 2.0, 1
    )
    assert form_blocks(p) == form_blocks_reference(p) == [0, 0, 1, 2, 2]
    # nothing fits together: every component is its own block
    p = dataclasses.replace(p, mem_limit=0.5)
    assert form_blocks(p) == [0, 1, 2, 3, 4]


def test_edge_cases() -> None:
    assert form_blocks(CoarsenProblem(0, [], [], [], math.inf, 3)) == []
    chain = [(c, [c + 1], 1.0) for c in range(5)]
    p = CoarsenProblem(6, chain, [1.0] * 6, [1.0] * 6, math.inf, 9)
    assert form_blocks(p) == list(range(6))  # k > n: one block per component
    assert form_blocks(dataclasses.replace(p, k=1)) == [0] * 6
    # the bandwidth scales every communication time alike, so it cannot change the blocks
    for q in CASES[:30]:
        assert form_blocks(dataclasses.replace(q, bandwidth=123.0)) == form_blocks(q)


def test_integer_inputs_are_treated_as_floats() -> None:
    p = CoarsenProblem(4, [(0, [1], 1), (1, [2], 10), (2, [3], 1)], [1, 1, 1, 1], [1, 1, 1, 1], 10, 2)
    assert form_blocks(p) == form_blocks_reference(p) == [0, 1, 1, 1]


# -- helpers -----------------------------------------------------------------------------


def test_is_convex_matches_closure() -> None:
    rng = random.Random(3)
    for p in CASES[:80]:
        edges = edges_of(p)
        reach = reachable_from(p.n, edges)
        for _ in range(5):
            members = {c for c in range(p.n) if rng.random() < 0.3}
            assert is_convex(p.n, edges, sorted(members)) == convex_by_closure(reach, members)
    assert not is_convex(3, [(0, 1), (1, 2)], [0, 2])
    assert is_convex(3, [(0, 1), (1, 2), (0, 2)], [0, 1])


def test_block_comm_bytes_counts_each_receiving_block_once() -> None:
    p = CoarsenProblem(4, [(0, [1, 2, 3], 5.0), (1, [3], 2.0)], [1.0] * 4, [1.0] * 4, math.inf, 2)
    assert block_comm_bytes(p, [0, 0, 0, 0]) == 0.0
    assert block_comm_bytes(p, [0, 1, 1, 1]) == 5.0  # block 1 receives value 0 once
    assert block_comm_bytes(p, [0, 1, 2, 2]) == 5.0 * 2 + 2.0


# -- bad input ----------------------------------------------------------------------------


def make(**changes: object) -> CoarsenProblem:
    base: dict[str, object] = dict(
        n=3, values=[(0, [1], 1.0), (1, [2], 1.0)], time=[1.0] * 3, memory=[1.0] * 3, mem_limit=10.0, k=2
    )
    base.update(changes)
    return CoarsenProblem(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(values=[(1, [0], 1.0)]), r"value 0 \(producer 1\) has consumer 0, which is not .* after"),
        (dict(values=[(0, [1], 1.0), (1, [1], 1.0)]), r"value 1 \(producer 1\) has consumer 1"),
        (dict(values=[(0, [3], 1.0)]), r"consumer 3"),
        (dict(values=[(5, [], 1.0)]), r"value 0 has producer 5, outside the components 0..2"),
        (dict(values=[(0, [1], -1.0)]), r"value 0 has bytes = -1.0"),
        (dict(time=[1.0, -0.5, 1.0]), r"time\[1\] = -0.5; it must be finite and >= 0"),
        (dict(memory=[1.0, math.nan, 1.0]), r"memory\[1\] = nan"),
        (dict(time=[1.0, 1.0]), r"time has 2 entries for n = 3 atomic components"),
        (dict(memory=[1.0] * 4), r"memory has 4 entries for n = 3"),
        (dict(k=0), r"k = 0; the number of blocks must be >= 1"),
        (dict(mem_limit=math.nan), r"mem_limit = nan"),
        (dict(bandwidth=0.0), r"bandwidth = 0.0"),
        (dict(n=-1, time=[], memory=[], values=[]), r"n = -1"),
    ],
)
def test_bad_input(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**changes)


def test_native_rejects_bad_input_itself() -> None:
    """Called directly, the extension checks what would make it read out of bounds."""
    with pytest.raises(ValueError, match="consumer 0, which is not a component after its producer"):
        _C.form_blocks(2, [(1, [0], 1.0)], [1.0, 1.0], [1.0, 1.0], 1.0, 1)
    with pytest.raises(ValueError, match="producer 7 outside"):
        _C.form_blocks(2, [(7, [], 1.0)], [1.0, 1.0], [1.0, 1.0], 1.0, 1)
    with pytest.raises(ValueError, match="time has 1 entries"):
        _C.form_blocks(2, [], [1.0], [1.0, 1.0], 1.0, 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        _C.form_blocks(2, [], [1.0, 1.0], [1.0, 1.0], 1.0, 0)
