"""Random valid cuts of the model set, run stage by stage with autograd cut at every
boundary (as the pipeline runtime does), equal the unwrapped model: outputs,
gradients of every parameter, and BatchNorm statistics."""

from __future__ import annotations

import copy
import functools
import random
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import BUILDERS, Case, make_case

from rannc.atomic.components import AtomicPartition, atomic_components
from rannc.errors import RaNNCError
from rannc.graph.capture import CapturedModel, capture, flatten_inputs
from rannc.graph.extract import (
    StageGraph,
    build_stage_module,
    check_buffer_writes_stay_in_one_stage,
    split_graph,
)
from rannc.graph.task_graph import ValueKind

pytestmark = pytest.mark.layer("pure")

RTOL, ATOL = 1e-6, 1e-7


@functools.cache
def captured(name: str) -> tuple[Case, CapturedModel, AtomicPartition]:
    case = make_case(name)
    cap = capture(copy.deepcopy(case.model), case.args, case.kwargs)
    return case, cap, atomic_components(cap.graph)


def random_cut(atomic: AtomicPartition, edges: list[tuple[int, int]], rng: random.Random,
               k: int) -> list[list[int]]:
    """A random linear extension of the component DAG, split into k contiguous groups."""
    n = len(atomic.components)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [c for c in range(n) if indeg[c] == 0]
    order: list[int] = []
    while ready:
        c = ready.pop(rng.randrange(len(ready)))
        order.append(c)
        for d in succ[c]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    k = min(k, n)
    cuts = sorted(rng.sample(range(1, n), k - 1))
    bounds = [0, *cuts, n]
    return [order[bounds[i]:bounds[i + 1]] for i in range(k)]


def run_with_boundaries(case: Case, cap: CapturedModel, stages: list[StageGraph]) -> Any:
    """Forward stage by stage, each stage's inputs from earlier stages detached; then the
    backward stage by stage in reverse, feeding each stage the gradients its consumers sent."""
    model = case.model
    modules = [build_stage_module(cap.gm, cap.graph, s) for s in stages]
    leaves, _ = flatten_inputs(case.args, case.kwargs)
    values = cap.bind(model, leaves)
    produced_by: dict[str, int] = {}
    copies: list[dict[str, torch.Tensor]] = []
    outputs: list[tuple[torch.Tensor, ...]] = []
    for s, mod in zip(stages, modules, strict=True):
        ins, mine = [], {}
        for v in s.inputs:
            x = values[v]
            if v in produced_by and isinstance(x, torch.Tensor) and x.is_floating_point():
                x = x.detach().requires_grad_(values[v].requires_grad)
                mine[v] = x
            ins.append(x)
        outs = mod(*ins)
        copies.append(mine)
        outputs.append(outs)
        for v, o in zip(s.outputs, outs, strict=True):
            values[v] = o
            produced_by[v] = s.index
    out = cap.unflatten_outputs(values)
    case.loss(out).backward(retain_graph=True)
    for s, outs in reversed(list(zip(stages, outputs, strict=True))):
        ts, gs = [], []
        for v, o in zip(s.outputs, outs, strict=True):
            grads = [c[v].grad for c in copies[s.index + 1:] if v in c and c[v].grad is not None]
            if grads and isinstance(o, torch.Tensor) and o.requires_grad:
                ts.append(o)
                gs.append(torch.stack(grads).sum(0))
        if ts:
            torch.autograd.backward(ts, gs)
    return out


def reference(case: Case) -> tuple[Any, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    model = copy.deepcopy(case.model)
    out = model(*case.args, **case.kwargs)
    case.loss(out).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out, grads, dict(model.named_buffers())


def check_cut(name: str, groups: list[list[int]]) -> None:
    case, cap, atomic = captured(name)
    stages = split_graph(cap.graph, atomic, groups)
    ref_out, ref_grads, ref_bufs = reference(case)
    run = case.fresh()
    out = run_with_boundaries(run, cap, stages)
    for x, y in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref_out), strict=True):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)
    for n, p in run.model.named_parameters():
        g = ref_grads[n]
        assert (p.grad is None) == (g is None), n
        if g is not None:
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL, msg=f"grad of {n}")
    for n, b in run.model.named_buffers():
        torch.testing.assert_close(b, ref_bufs[n], rtol=RTOL, atol=ATOL, msg=f"buffer {n}")


@pytest.mark.parametrize("name", sorted(BUILDERS))
@settings(max_examples=6, deadline=None, derandomize=True)
@given(rng=st.randoms(use_true_random=False), k=st.integers(2, 6))
def test_random_cuts_equal_the_original(name: str, rng: random.Random, k: int) -> None:
    _, cap, atomic = captured(name)
    check_cut(name, random_cut(atomic, atomic.component_edges(cap.graph), rng, k))


def test_every_component_its_own_stage() -> None:
    _, cap, atomic = captured("fork_join")
    check_cut("fork_join", [[c] for c in range(len(atomic.components))])


def test_cut_out_of_order_is_rejected_with_the_modules_named() -> None:
    _, cap, atomic = captured("fork_join")
    n = len(atomic.components)
    with pytest.raises(RaNNCError, match="not executable in order"):
        split_graph(cap.graph, atomic, [list(range(n // 2, n)), list(range(n // 2))])
    with pytest.raises(RaNNCError, match="leaves out"):
        split_graph(cap.graph, atomic, [list(range(n - 1))])
    with pytest.raises(RaNNCError, match="in groups"):
        split_graph(cap.graph, atomic, [list(range(n)), [0]])


def test_stage_interfaces_are_minimal() -> None:
    """A stage takes only what its tasks read and gives only what later stages or outputs need."""
    _, cap, atomic = captured("bert")
    n = len(atomic.components)
    stages = split_graph(cap.graph, atomic, [list(range(n // 3)), list(range(n // 3, n))])
    later_reads = set(stages[1].inputs)
    assert set(stages[0].outputs) <= later_reads | {v for v in cap.graph.outputs if v}
    kinds = {cap.graph.values[v].kind for v in stages[1].inputs}
    assert ValueKind.INPUT in kinds  # labels go straight to the stage that needs them
    assert "labels" not in stages[0].inputs or "labels" not in stages[0].outputs


class _ReadEarlyWriteLate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x + self.ema)))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h


def test_a_buffer_read_in_one_stage_and_written_in_another_is_refused() -> None:
    """On several ranks each stage holds its own copy of a buffer: the reader would keep a stale
    one. The first component reads the buffer, the update follows the last Linear."""
    cap = capture(_ReadEarlyWriteLate(), (torch.randn(3, 4),))
    atomic = atomic_components(cap.graph)
    n = len(atomic.components)
    stages = split_graph(cap.graph, atomic, [[0], list(range(1, n))])
    with pytest.raises(RaNNCError, match=r"buffer 'ema' is updated in place in stage 1 .* stage\(s\) \[0\]"):
        check_buffer_writes_stay_in_one_stage(cap.graph, stages)
    check_buffer_writes_stay_in_one_stage(cap.graph, split_graph(cap.graph, atomic, [list(range(n))]))
