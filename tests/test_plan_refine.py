"""Stage boundaries finer than blocks: the vectorised block-range tables against a plain
reference, and the planner's boundary refinement (`rannc.stage_dp.refine`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from model_zoo import BUILDERS, make_case

from rannc.atomic.components import AtomicPartition, atomic_components
from rannc.graph.capture import capture
from rannc.graph.task_graph import TaskGraph, ValueKind
from rannc.profile.estimate import _bytes
from rannc.stage_dp.tables import BlockIO

logging.getLogger("transformers").setLevel(logging.ERROR)


def block_io_reference(graph: TaskGraph, atomic: AtomicPartition, block_of: list[int]) -> BlockIO:
    """BlockIO.of as a plain loop over every first block l of a range, per value."""
    k = max(block_of) + 1
    inputs, outputs = np.zeros((2, k, k)), np.zeros((2, k, k))
    params, grad_params = np.zeros((k, k)), np.zeros((k, k))
    cut_ok = np.ones(k + 1, dtype=bool)
    blocks_of_task = [sorted({block_of[c] for c in h}) for h in atomic.holders]
    out_names = {v for v in graph.outputs if v is not None}
    for name, val in graph.values.items():
        consumers = sorted({b for t in graph.consumers(name) for b in blocks_of_task[t]})
        if val.kind in (ValueKind.PARAM, ValueKind.BUFFER):
            for lo in range(k):
                nxt = next((b for b in consumers if b >= lo), None)
                if nxt is not None:
                    params[lo, nxt:] += sum(_bytes(val))
                    if val.kind is ValueKind.PARAM:
                        grad_params[lo, nxt:] += sum(_bytes(val))
            continue
        if val.kind not in (ValueKind.INPUT, ValueKind.ACTIVATION) or not val.is_tensor:
            continue
        prod = graph.producer(name)
        if prod is not None and atomic.component_of[prod] < 0:
            continue
        p = -1 if prod is None else block_of[atomic.component_of[prod]]
        last = k if name in out_names else max(consumers, default=p)
        b = np.array(_bytes(val))
        for lo in range(p + 1, k):
            nxt = next((c for c in consumers if c >= lo), None)
            if nxt is not None:
                inputs[:, lo, nxt:] += b[:, None]
        if p >= 0 and last > p:
            for lo in range(p + 1):
                outputs[:, lo, p:last] += b[:, None]
            if val.kind is ValueKind.ACTIVATION and val.batch_dim is None:
                cut_ok[p + 1:min(last, k) + 1] = False
    cut_ok[0] = cut_ok[k] = True
    return BlockIO(inputs, outputs, params, grad_params, cut_ok)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_block_io_matches_the_plain_loop(name: str) -> None:
    case = make_case(name, batch=4)
    graph = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(graph)
    n = len(atomic.components)
    rng = np.random.default_rng(0)
    for k in sorted({1, 2, min(5, n), n}):
        cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False)) if k > 1 else []
        block_of = np.searchsorted(np.asarray(cuts), np.arange(n), side="right").tolist()
        got, want = BlockIO.of(graph, atomic, block_of), block_io_reference(graph, atomic, block_of)
        for field in ("inputs", "outputs", "params", "grad_params", "cut_ok"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), (k, field)
