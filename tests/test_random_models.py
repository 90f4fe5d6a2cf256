"""Exactness under random models, single-process layer (issue 9): random DAG models
(tests/random_models.py: fork/join, skip connections, shared parameters, several outputs,
in-place ops, BatchNorm, LayerNorm, a keyword input) are captured and run split into a random
number of stages along a random valid cut, autograd cut at every stage boundary as the pipeline
runtime does (test_stage_extraction.run_with_boundaries), and compared with the unwrapped model:
every output, every parameter's gradient and the BatchNorm buffers (fp32).

Capture (torch.export) costs ~0.5 s a model on this machine, so each hypothesis example is one
model checked under LAYOUTS random cuts (stage count 1..#components, random linear extension
of the component DAG): MODELS models, MODELS * LAYOUTS layouts in all.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import Case
from random_models import DagSpec, Node, build, dag_specs, make_inputs, user_loss
from test_stage_extraction import random_cut, run_with_boundaries

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.graph.extract import split_graph

pytestmark = pytest.mark.layer("pure")

RTOL, ATOL = 1e-5, 1e-6
MODELS = 60
LAYOUTS = 5
BATCH = 5


def check_model(spec: DagSpec, rngs: list[random.Random], ks: list[int]) -> None:
    model = build(spec)
    args, kwargs = make_inputs(spec, BATCH)
    case = Case("random", model, args, kwargs, user_loss)
    cap = capture(copy.deepcopy(model), args, kwargs)
    atomic = atomic_components(cap.graph)
    edges = atomic.component_edges(cap.graph)
    ref = copy.deepcopy(model)
    ref_out = ref(*args, **kwargs)
    user_loss(ref_out).backward()
    for rng, k in zip(rngs, ks, strict=True):
        groups = random_cut(atomic, edges, rng, min(k, len(atomic.components)))
        run = case.fresh()
        what = f"{len(groups)} stages {groups}\n{spec.describe()}"
        out = run_with_boundaries(run, cap, split_graph(cap.graph, atomic, groups))
        assert_same(out, ref_out, run.model, ref, what)


def assert_same(out: Any, ref_out: Any, model: torch.nn.Module, ref: torch.nn.Module,
                what: str) -> None:
    la, sa = pytree.tree_flatten(out)
    lb, sb = pytree.tree_flatten(ref_out)
    assert str(sa) == str(sb), f"output structure {sa} != {sb}: {what}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"output {i}: {m}; {what}")
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g = ref_params[n].grad
        assert (p.grad is None) == (g is None), f"grad of {n}: {p.grad} vs {g}; {what}"
        if g is not None:
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"grad of {n}: {m}; {what}")
    ref_bufs = dict(ref.named_buffers())
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_bufs[n], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=n: f"buffer {n}: {m}; {what}")


@settings(max_examples=MODELS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=dag_specs(),
       rngs=st.lists(st.randoms(use_true_random=False), min_size=LAYOUTS, max_size=LAYOUTS),
       ks=st.lists(st.integers(1, 14), min_size=LAYOUTS, max_size=LAYOUTS))
def test_random_model_in_random_stages_equals_unwrapped(spec: DagSpec, rngs: list[random.Random],
                                                        ks: list[int]) -> None:
    check_model(spec, rngs, ks)


def _cut_by_ops(spec: DagSpec, stages: list[list[str]]) -> None:
    """Run `spec` cut into stages given as the ops of their atomic components, in graph order
    (e.g. [["linear", "add_"], ["add", "linear"]]), against the unwrapped model."""
    model = build(spec)
    args, kwargs = make_inputs(spec, BATCH)
    cap = capture(copy.deepcopy(model), args, kwargs)
    atomic = atomic_components(cap.graph)
    ops = [cap.graph.tasks[c.task].op.split(".")[1] for c in atomic.components]
    groups: list[list[int]] = []
    free = list(range(len(ops)))
    for names in stages:
        groups.append([])
        for name in names:
            c = next(c for c in free if ops[c] == name)
            free.remove(c)
            groups[-1].append(c)
    assert not free, f"components {[ops[c] for c in free]} in no stage"
    ref = copy.deepcopy(model)
    ref_out = ref(*args, **kwargs)
    user_loss(ref_out).backward()
    run = Case("regression", model, args, kwargs, user_loss)
    out = run_with_boundaries(run, cap, split_graph(cap.graph, atomic, groups))
    assert_same(out, ref_out, run.model, ref, spec.describe())


def _spec(nodes: list[Node], outputs: tuple[int, ...], linears: int = 2) -> DagSpec:
    return DagSpec(in_width=4, in2_width=0, y_by_keyword=False, linears=((4, 4),) * linears,
                   norms=(), nodes=tuple(nodes), outputs=outputs, form="tuple", scalar=False)


def test_in_place_write_into_a_stage_input() -> None:
    """Found by the random models: `t = linear(x); t.add_(x)` with the add_ in the next stage
    wrote into the received activation, an autograd leaf ("a leaf Variable that requires grad
    is being used in an in-place operation"); the stage now writes into a copy."""
    spec = _spec([Node("linear", (0,), module=0), Node("add_", (1, 0)),
                  Node("relu_", (2,)), Node("linear", (3,), module=1)], outputs=(4,))
    _cut_by_ops(spec, [["linear"], ["add_", "relu_", "linear"]])
    _cut_by_ops(spec, [["linear"], ["add_"], ["relu_"], ["linear"]])


def test_in_place_write_after_a_read_in_a_later_stage() -> None:
    """`t = linear(x); u = t + x; t.add_(x)`: the add after the write in stage order, `u` in
    the next stage, must read t as it was before the write (the stage sends a copy)."""
    spec = _spec([Node("linear", (0,), module=0), Node("add", (1, 0)), Node("add_", (1, 0)),
                  Node("linear", (3,), module=1)], outputs=(4, 2))
    _cut_by_ops(spec, [["linear", "add_"], ["add", "linear"]])
    _cut_by_ops(spec, [["linear", "add_", "linear"], ["add"]])


def test_capture_drops_dead_branches_but_keeps_batchnorm_statistics() -> None:
    """Found by the multi-rank random models: a branch no output depends on was captured and
    run, and across a stage boundary gave its producer a zero gradient (None in the original).
    Capture now drops it, except what updates state: a BatchNorm (its running statistics)."""
    spec = _spec([Node("linear", (0,), module=0), Node("linear", (1,), module=1),
                  Node("act", (1,), act="tanh"), Node("bn", (1,), module=0)], outputs=(2,))
    spec = DagSpec(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
                      "norms": (("bn", 4),)})
    model = build(spec)
    args, kwargs = make_inputs(spec, BATCH)
    cap = capture(copy.deepcopy(model), args, kwargs)
    ops = [t.op for t in cap.graph.tasks]
    assert "aten.tanh.default" not in ops, ops
    assert "aten.batch_norm.default" in ops, ops
    _cut_by_ops(spec, [["linear"], ["linear", "batch_norm"]])


def test_too_small_a_batch_for_the_forced_microbatches_says_so() -> None:
    """Found by the multi-rank random models: 4 forced microbatches on a global batch of 2
    rows failed with "the model needs at least inf GB per device"."""
    spec = _spec([Node("linear", (0,), module=0), Node("linear", (1,), module=1)], outputs=(2,))
    with pytest.raises(rannc.RaNNCError, match="global batch of 2 rows cannot be split.*at least 4 rows"):
        rannc.plan(build(spec), make_inputs(spec, 2)[0],
                   cluster=rannc.Cluster.homogeneous(n=2, per_node=2),
                   config=rannc.Config(microbatches=4, replicas=[1, 1], profiler="estimate"))
