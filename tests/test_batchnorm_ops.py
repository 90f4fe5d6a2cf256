"""rannc.pipeline.batchnorm in one process: every batch-norm op form it replaces (before and
after functionalisation) gives the op's outputs without writing the buffers, and the deferred
update gives the running statistics of one BatchNorm call on the whole batch."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from rannc.graph.task_graph import Task, TaskGraph, Value, ValueKind
from rannc.pipeline import batchnorm as bnorm

pytestmark = pytest.mark.layer("pure")

OPS = [torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
       torch.ops.aten._native_batch_norm_legit.default,
       torch.ops.aten._native_batch_norm_legit_functional.default]


def _stage(op: torch._ops.OpOverload) -> tuple[fx.GraphModule, TaskGraph]:
    """A stage module holding one training-mode batch norm in `op`'s form, as capture gives it
    (the functional form followed by its copies into the buffers)."""
    g = fx.Graph()
    x, w, b, rm, rv = (g.placeholder(n) for n in ("x", "w", "b", "rm", "rv"))
    x.meta["val"] = torch.empty(6, 3, 5)
    args = (x, w, b, rm, rv, True, 0.1, 1e-5) + ((False,) if op is OPS[0] else ())
    bn = g.call_function(op, args)
    bn.name = "bn"
    if op is OPS[0]:
        out = bn
    else:
        out = g.call_function(operator.getitem, (bn, 0))
        if op is OPS[3]:
            for i, buf in ((3, rm), (4, rv)):
                new = g.call_function(operator.getitem, (bn, i))
                g.call_function(torch.ops.aten.copy_.default, (buf, new))
    g.output((out,))
    names = {"rm": "norm.running_mean", "rv": "norm.running_var"}
    values = {n: Value(n, ValueKind.BUFFER, (3,), "float32", target=t) for n, t in names.items()}
    values["x"] = Value("x", ValueKind.INPUT, ("batch", 3, 5), "float32", 0)
    values.update({n: Value(n, ValueKind.PARAM, (3,), "float32", target=n) for n in ("w", "b")})
    values["bn"] = Value("bn", ValueKind.ACTIVATION, ("batch", 3, 5), "float32", 0, producer="bn")
    graph = TaskGraph(tasks=[Task("bn", str(op), ("x", "w", "b", "rm", "rv"), ("bn",), "norm")],
                      values=values, inputs=["x"], outputs=["bn"])
    return fx.GraphModule(torch.nn.Module(), g), graph


@pytest.mark.parametrize("op", OPS, ids=[str(o) for o in OPS])
def test_every_form_is_replaced_and_defers_the_statistics(op: torch._ops.OpOverload) -> None:
    gm, graph = _stage(op)
    state = bnorm.BatchNormState("local", None)
    assert bnorm.install(gm, graph, state) == 1
    assert not any(n.target is op for n in gm.graph.nodes)
    ref = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        ref.weight.uniform_()
        ref.bias.uniform_()
    x = torch.randn(6, 3, 5) * 2 + 1
    rm, rv = torch.zeros(3), torch.ones(3)
    buffers = {"norm.running_mean": rm, "norm.running_var": rv}
    state.begin_call(buffers)
    state.accumulate = True
    outs = [gm(x[i:i + 3], ref.weight, ref.bias, rm, rv)[0] for i in (0, 3)]  # 2 microbatches
    state.accumulate = False
    assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))  # not written
    state.finish_call(buffers, torch.device("cpu"))
    want = ref(x)
    for i, o in zip((0, 3), outs, strict=True):  # each microbatch normalised over its rows
        ref_mb = torch.nn.functional.batch_norm(x[i:i + 3], None, None, ref.weight, ref.bias, True)
        torch.testing.assert_close(o, ref_mb)
    assert not torch.allclose(torch.cat(outs), want)
    torch.testing.assert_close(rm, ref.running_mean)  # once, from the whole batch
    torch.testing.assert_close(rv, ref.running_var)


def test_eval_mode_batch_norm_is_left_alone() -> None:
    gm, graph = _stage(OPS[0])
    node = next(n for n in gm.graph.nodes if n.target is OPS[0])
    node.args = (*node.args[:5], False, *node.args[6:])
    assert bnorm.install(gm, graph, bnorm.BatchNormState("local", None)) == 0


def _two_sites() -> tuple[fx.GraphModule, TaskGraph]:
    """Two training-mode batch norms of different widths in one stage (3 then 4 channels)."""
    g = fx.Graph()
    x, w1, b1, rm1, rv1, w2, b2, rm2, rv2 = (g.placeholder(n) for n in (
        "x", "w1", "b1", "rm1", "rv1", "w2", "b2", "rm2", "rv2"))
    x.meta["val"] = torch.empty(6, 3, 5)
    op = OPS[2]
    bn1 = g.call_function(op, (x, w1, b1, rm1, rv1, True, 0.1, 1e-5))
    bn1.name = "bn1"
    h = g.call_function(operator.getitem, (bn1, 0))
    first = g.call_function(torch.ops.aten.slice.Tensor, (h, 1, 0, 1))
    wide = g.call_function(torch.ops.aten.cat.default, ([h, first], 1))
    wide.meta["val"] = torch.empty(6, 4, 5)
    bn2 = g.call_function(op, (wide, w2, b2, rm2, rv2, True, 0.3, 1e-3))
    bn2.name = "bn2"
    g.output((g.call_function(operator.getitem, (bn2, 0)),))
    values = {n: Value(n, ValueKind.BUFFER, (c,), "float32", target=t) for n, c, t in (
        ("rm1", 3, "a.running_mean"), ("rv1", 3, "a.running_var"),
        ("rm2", 4, "b.running_mean"), ("rv2", 4, "b.running_var"))}
    values["x"] = Value("x", ValueKind.INPUT, ("batch", 3, 5), "float32", 0)
    values.update({n: Value(n, ValueKind.PARAM, (c,), "float32", target=n)
                   for n, c in (("w1", 3), ("b1", 3), ("w2", 4), ("b2", 4))})
    for n, c in (("bn1", 3), ("bn2", 4)):
        values[n] = Value(n, ValueKind.ACTIVATION, ("batch", c, 5), "float32", 0, producer=n)
    tasks = [Task("bn1", str(op), ("x", "w1", "b1", "rm1", "rv1"), ("bn1",), "a"),
             Task("bn2", str(op), ("bn1", "w2", "b2", "rm2", "rv2"), ("bn2",), "b")]
    graph = TaskGraph(tasks=tasks, values=values, inputs=["x"], outputs=["bn2"])
    return fx.GraphModule(torch.nn.Module(), g), graph


@pytest.mark.parametrize("uneven", [False, True], ids=["every-site-every-microbatch", "uneven"])
def test_several_sites_update_once_from_the_whole_batch(uneven: bool) -> None:
    """Sites of different widths and momentums, summed together (or site by site when a site
    ran fewer microbatches than another): each site's running statistics are those of one
    BatchNorm call on all the rows it saw."""
    gm, graph = _two_sites()
    state = bnorm.BatchNormState("local", None)
    assert bnorm.install(gm, graph, state) == 2
    ref1, ref2 = torch.nn.BatchNorm1d(3, momentum=0.1), torch.nn.BatchNorm1d(4, momentum=0.3, eps=1e-3)
    buffers = {"a.running_mean": torch.zeros(3), "a.running_var": torch.ones(3),
               "b.running_mean": torch.zeros(4), "b.running_var": torch.ones(4)}
    x = torch.randn(9, 3, 5) * 2 + 1
    args = (ref1.weight, ref1.bias, buffers["a.running_mean"], buffers["a.running_var"],
            ref2.weight, ref2.bias, buffers["b.running_mean"], buffers["b.running_var"])
    state.begin_call(buffers)
    state.accumulate = True
    for lo, hi in ((0, 3), (3, 6), (6, 9)):
        gm(x[lo:hi], *args)
    # the kernel's own statistics were recorded, no pass over the inputs
    assert {k: len(v) for k, v in state.moments.items()} == {"bn1": 3, "bn2": 3}
    assert not state.sums
    if uneven:  # one more record for site 1 alone: its rows count too
        x = torch.cat([x, torch.randn(2, 3, 5)])
        state.add("bn1", x[9:])
    state.accumulate = False
    state.finish_call(buffers, torch.device("cpu"))
    with torch.no_grad():
        ref1.train()(x)
        # site 2's input: each microbatch normalised over its own rows by site 1
        h = torch.cat([torch.nn.functional.batch_norm(x[lo:lo + 3], None, None, ref1.weight,
                                                      ref1.bias, True) for lo in (0, 3, 6)])
        ref2.train()(torch.cat([h, h[:, :1]], 1))
    torch.testing.assert_close(buffers["a.running_mean"], ref1.running_mean)
    torch.testing.assert_close(buffers["a.running_var"], ref1.running_var)
    torch.testing.assert_close(buffers["b.running_mean"], ref2.running_mean)
    torch.testing.assert_close(buffers["b.running_var"], ref2.running_var)
