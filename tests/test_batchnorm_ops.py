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
