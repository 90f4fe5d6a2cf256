"""Block formation (paper III-B) written plainly: the reference for `rannc._C.form_blocks`.

This module states the algorithm; `csrc/coarsen.cpp` makes it fast. Both must
return the identical grouping, so every choice here is made from canonical
keys, never from an iteration order that only one implementation has:

- a group is named in ties by its smallest member (component index);
- whether a grouping is valid is decided from its definition: the graph
  between groups (the quotient) must be acyclic and every group must fit
  `mem_limit`. An acyclic quotient makes every group convex and lets the
  blocks be numbered in pipeline order. (Convex groups alone are not enough:
  {a, b} and {c, d} with a -> c and d -> b are both convex, yet each group
  needs the other first.) The native code checks the same property with
  bounded searches over topological orders it maintains; here it is checked
  by rebuilding the quotient and running Kahn's algorithm, which is slow
  (O(n + e) per check) but obviously right;
- floating-point sums are written as explicit loops in a fixed order, never
  with `sum()` (Python 3.12 made `sum()` of floats compensated, which C++'s
  `+=` is not), so both sides round alike.

Index conventions: c, d index components (0..n-1, a topological order);
i indexes values; g, v, w, s, t name groups; L is a level of the coarsening
(level 0: one group per component; level L + 1 is level L with pairs merged).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

Value = tuple[int, Sequence[int], float]  # (producer, consumers, bytes)


@dataclass(slots=True)
class Problem:
    """The validated, float-normalised input (see blocks.CoarsenProblem)."""

    n: int
    values: list[tuple[int, tuple[int, ...], float]]
    time: list[float]
    memory: list[float]
    mem_limit: float
    k: int
    edges: list[tuple[int, int]] = field(init=False)  # (producer, consumer), sorted, no repeats
    touches: list[list[int]] = field(init=False)  # per component: ascending values it produces or reads

    def __post_init__(self) -> None:
        self.edges = sorted({(p, c) for p, cs, _ in self.values for c in cs})
        touches: list[set[int]] = [set() for _ in range(self.n)]
        for i, (p, cs, _) in enumerate(self.values):
            touches[p].add(i)
            for c in cs:
                touches[c].add(i)
        self.touches = [sorted(t) for t in touches]


@dataclass(slots=True)
class Hierarchy:
    """The coarsening's levels: levels[L][c] is the group of c at level L, and
    pairs[L] lists the (initiator, partner) groups of level L merged into one
    group of level L + 1, in the order they were merged."""

    levels: list[list[int]]
    pairs: list[list[tuple[int, int]]]


# -- the validity of a grouping -------------------------------------------------


def quotient_is_acyclic(edges: Sequence[tuple[int, int]], group_of: Sequence[int]) -> bool:
    """Whether the graph between groups has no cycle (Kahn's algorithm)."""
    succ: dict[int, set[int]] = {g: set() for g in group_of}
    for a, b in edges:
        if group_of[a] != group_of[b]:
            succ[group_of[a]].add(group_of[b])
    indeg = dict.fromkeys(succ, 0)
    for ss in succ.values():
        for s in ss:
            indeg[s] += 1
    ready = [g for g, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        g = ready.pop()
        seen += 1
        for s in succ[g]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return seen == len(succ)


def canonical_order(edges: Sequence[tuple[int, int]], group_of: Sequence[int]) -> list[int]:
    """The groups in topological order, the ready group with the smallest member first."""
    first: dict[int, int] = {}
    for c, g in enumerate(group_of):
        first.setdefault(g, c)
    succ: dict[int, set[int]] = {g: set() for g in first}
    for a, b in edges:
        if group_of[a] != group_of[b]:
            succ[group_of[a]].add(group_of[b])
    indeg = dict.fromkeys(first, 0)
    for ss in succ.values():
        for s in ss:
            indeg[s] += 1
    heap = [(first[g], g) for g, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, g = heapq.heappop(heap)
        order.append(g)
        for s in succ[g]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (first[s], s))
    if len(order) != len(first):
        raise AssertionError("the grouping has a cycle between groups; this is a bug in form_blocks")
    return order


def adjacent_groups(p: Problem, group_of: Sequence[int], g: int) -> set[int]:
    """The groups other than g joined to g by a value (either direction)."""
    out: set[int] = set()
    for a, b in p.edges:
        ga, gb = group_of[a], group_of[b]
        if ga != gb and g in (ga, gb):
            out.add(gb if ga == g else ga)
    return out


# -- coarsening -------------------------------------------------------------------


def coarsen(p: Problem) -> Hierarchy:
    """Merge pairs of adjacent groups level by level until k groups remain or a
    level merges nothing. A group's id is its smallest member when its level is formed."""
    group_of = list(range(p.n))
    time = {c: p.time[c] for c in range(p.n)}
    mem = {c: p.memory[c] for c in range(p.n)}
    h = Hierarchy(levels=[group_of], pairs=[])
    count = p.n
    while count > p.k:
        cur = list(group_of)  # level L with this level's merges applied (merged groups keep v's id)
        merged: set[int] = set()
        pairs: list[tuple[int, int]] = []
        for v in sorted(time, key=lambda g: (time[g], g)):
            if count <= p.k:
                break
            if v in merged:
                continue
            # unmerged v, w have the same neighbours in cur as in level L
            cands = sorted(
                (time[v] + time[w], w)
                for w in adjacent_groups(p, group_of, v)
                if w not in merged and mem[v] + mem[w] <= p.mem_limit
            )
            for _, w in cands:
                trial = [v if g == w else g for g in cur]
                if quotient_is_acyclic(p.edges, trial):
                    cur = trial
                    merged |= {v, w}
                    pairs.append((v, w))
                    count -= 1
                    break
        if not pairs:
            break
        partner = dict(pairs)
        new_id = {v: min(v, w) for v, w in pairs}
        next_time: dict[int, float] = {}
        next_mem: dict[int, float] = {}
        for g in time:
            if g in merged and g not in partner:
                continue  # a partner: counted with its initiator
            gid = new_id.get(g, g)
            if g in partner:
                next_time[gid] = time[g] + time[partner[g]]
                next_mem[gid] = mem[g] + mem[partner[g]]
            else:
                next_time[gid], next_mem[gid] = time[g], mem[g]
        group_of = [new_id.get(g, g) for g in cur]
        time, mem = next_time, next_mem
        h.levels.append(group_of)
        h.pairs.append(pairs)
    return h


# -- uncoarsening -----------------------------------------------------------------


def comm_change(
    p: Problem, group_of: Sequence[int], x: set[int], x_values: Sequence[int], t: int
) -> tuple[float, float]:
    """Bytes sent between groups (before, after) over the values touching x when
    x's members move to group t. A value goes once to each distinct group, other
    than its producer's, that holds one of its consumers."""
    before = after = 0.0
    for i in x_values:
        prod, cons, nbytes = p.values[i]
        gb = group_of[prod]
        ga = t if prod in x else gb
        receivers_before = {group_of[c] for c in cons} - {gb}
        receivers_after = {t if c in x else group_of[c] for c in cons} - {ga}
        for _ in receivers_before:
            before += nbytes
        for _ in receivers_after:
            after += nbytes
    return before, after


def fits(p: Problem, members: Sequence[int]) -> bool:
    """Whether members' memory (summed in ascending component order) is within the limit."""
    total = 0.0
    for c in sorted(members):
        total += p.memory[c]
    return total <= p.mem_limit


def move_is_valid(p: Problem, h: Hierarchy, step: int, x: set[int], t0: int) -> bool:
    """Moving x (a group of level `step`) to the group of component t0 keeps every
    coarser level that changes acyclic and within memory."""
    x0 = min(x)
    for lv in h.levels[step + 1 :]:
        s, t = lv[x0], lv[t0]
        if s == t:
            break  # this level and all coarser ones already hold x and t together
        if not fits(p, [c for c, g in enumerate(lv) if g == t or c in x]):
            return False
        if not quotient_is_acyclic(p.edges, [t if c in x else g for c, g in enumerate(lv)]):
            return False
    return True


def apply_move(h: Hierarchy, step: int, x: set[int], t0: int) -> None:
    x0 = min(x)
    for lv in h.levels[step + 1 :]:
        s, t = lv[x0], lv[t0]
        if s == t:
            break
        for c in x:
            lv[c] = t


def uncoarsen(p: Problem, h: Hierarchy) -> int:
    """From the coarsest level down, try to move one half of each merged pair into
    a group adjacent to the pair one level up. A move must send strictly fewer bytes
    between that level's groups and, if it changes the final groups, strictly fewer
    between those (a tie there would only reshuffle balanced blocks). Returns the
    number of moves made."""
    top = len(h.levels) - 1
    moves = 0
    for step in range(top - 1, -1, -1):
        fine = h.levels[step]
        members: dict[int, list[int]] = {}
        for c, g in enumerate(fine):
            members.setdefault(g, []).append(c)
        for v, w in h.pairs[step]:
            coarse = h.levels[step + 1]
            s = coarse[members[v][0]]
            cands: list[tuple[float, int, int, set[int]]] = []
            for xi, g in enumerate((v, w)):
                x = set(members[g])
                x_values = sorted({i for c in members[g] for i in p.touches[c]})
                for t in adjacent_groups(p, coarse, s):
                    b1, a1 = comm_change(p, coarse, x, x_values, t)
                    if not a1 < b1:
                        continue
                    t0 = min(c for c, gg in enumerate(coarse) if gg == t)
                    s_top, t_top = h.levels[top][members[g][0]], h.levels[top][t0]
                    if s_top != t_top:  # the final groups change too: they must gain as well
                        bt, at = comm_change(p, h.levels[top], x, x_values, t_top)
                        if not at < bt:
                            continue
                    cands.append((a1 - b1, xi, t0, x))
            cands.sort(key=lambda cand: cand[:3])
            for _, _, t0, x in cands:
                if move_is_valid(p, h, step, x, t0):
                    apply_move(h, step, x, t0)
                    moves += 1
                    break
    return moves


# -- compaction and numbering -------------------------------------------------------


def compact(p: Problem, group_of: list[int]) -> list[int]:
    """Merge neighbours in a topological order of the groups until k remain; returns
    the new group of each component (ids are old group ids)."""
    seq = canonical_order(p.edges, group_of)
    time = dict.fromkeys(seq, 0.0)
    mem = dict.fromkeys(seq, 0.0)
    first: dict[int, int] = {}
    for c, g in enumerate(group_of):
        time[g] += p.time[c]
        mem[g] += p.memory[c]
        first.setdefault(g, c)
    root = {g: g for g in seq}
    while len(seq) > p.k:
        done = False
        for i in sorted(range(len(seq)), key=lambda j: (time[seq[j]], first[seq[j]])):
            v = seq[i]
            nbrs = [j for j in (i - 1, i + 1) if 0 <= j < len(seq)]
            nbrs.sort(key=lambda j: time[seq[j]])  # stable: the left one on equal times
            for j in nbrs:
                w = seq[j]
                if mem[v] + mem[w] <= p.mem_limit:
                    a, b = seq[min(i, j)], seq[max(i, j)]
                    time[a], mem[a] = time[v] + time[w], mem[v] + mem[w]
                    first[a] = min(first[a], first[b])
                    root[b] = a
                    del seq[max(i, j)]
                    done = True
                    break
            if done:
                break
        if not done:
            break

    def find(g: int) -> int:
        while root[g] != g:
            g = root[g]
        return g

    return [find(g) for g in group_of]


def number_blocks(p: Problem, group_of: Sequence[int]) -> list[int]:
    """Renumber groups 0..m-1 in the canonical topological order."""
    number = {g: b for b, g in enumerate(canonical_order(p.edges, group_of))}
    return [number[g] for g in group_of]


def form_blocks(p: Problem, *, uncoarsen_step: bool = True) -> list[int]:
    if p.n == 0:
        return []
    h = coarsen(p)
    if uncoarsen_step:
        uncoarsen(p, h)
    return number_blocks(p, compact(p, list(h.levels[-1])))
