"""Random DAG models for property-based exactness tests (hypothesis).

A model is described as data (`DagSpec`: its modules, a list of nodes over numbered values,
which values it returns and in what form) and `RandomDag.forward` interprets that description,
so every drawn model is an ordinary `nn.Module` that torch.export traces through.

Values are numbered in order of creation: value 0 is the input `x` [B, in_width], value 1 the
optional second input `y` [B, in2_width] (passed positionally or by keyword), then one value
per node. Every value is a [B, width] float tensor; every op is row-wise except BatchNorm.

The node kinds cover what the exactness guarantee must survive:
- `linear` (a Linear module; a later node may reuse the SAME module: shared parameters),
- `act` (relu, gelu, tanh, sigmoid),
- `add`, `mul` (two equal-width values: fork/join, skip connections), `cat` (two values),
- `add_`, `relu_`: in-place on an intermediate. Only where autograd allows it in the
  original model: the target is not an input, neither its producer (Linear, add, mul, cat,
  the norms, add_) nor any node that read it before (add, cat, add_'s second operand) saved
  it for backward; it is then dead under its old number and lives on as the in-place node's
  value. A target read before the write exercises the pipeline's write-after-read case,
- `bn` (BatchNorm1d, training statistics, updates its running buffers), `ln` (LayerNorm).

Outputs: one tensor, a tuple or a dict of batch values, optionally with a scalar loss
`mean(v ** 2)` of one of them. The scalar is a mean over rows, so the pipeline's row-weighted
mean over microbatches and replicas gives the global value (DESIGN.md, "Outputs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")
# Ops whose result autograd does not save for their own backward: an in-place op may follow.
_INPLACE_OK = frozenset({"linear", "add", "mul", "cat", "bn", "ln", "add_"})
# Ops that do not save their operands (add_: its second one) for backward.
_KEEPS_NO_INPUT = frozenset({"add", "cat", "add_"})
MAX_WIDTH = 16


@dataclass(frozen=True, slots=True)
class Node:
    op: str  # linear, act, add, mul, cat, add_, relu_, bn, ln
    args: tuple[int, ...]  # value numbers read
    module: int = -1  # linear: index into linears; bn/ln: index into norms
    act: str = ""  # act: which activation


@dataclass(frozen=True, slots=True)
class DagSpec:
    in_width: int
    in2_width: int  # 0: no second input
    y_by_keyword: bool  # the second input passed as `y=` rather than positionally
    linears: tuple[tuple[int, int], ...]  # (in_features, out_features)
    norms: tuple[tuple[str, int], ...]  # ("bn" | "ln", width)
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]  # value numbers returned, in order
    form: str  # tensor, tuple, dict
    scalar: bool  # also return mean(v ** 2) of the first output value

    @property
    def has_batchnorm(self) -> bool:
        return any(kind == "bn" for kind, _ in self.norms)

    def _live(self) -> list[bool]:
        """Per node: whether an output depends on it."""
        first = 2 if self.in2_width else 1
        need = set(self.outputs)
        for i in reversed(range(len(self.nodes))):
            if first + i in need:
                need.update(self.nodes[i].args)
        return [first + i in need for i in range(len(self.nodes))]

    def live_nodes(self) -> int:
        """How many nodes the outputs depend on: at least that many atomic components remain
        after capture drops dead code (so at most that many stages can be forced)."""
        return sum(self._live())

    def describe(self) -> str:
        """One line per node, to read a failing example."""
        lines = [f"x[{self.in_width}]" + (f", y[{self.in2_width}]" if self.in2_width else "")]
        first = 2 if self.in2_width else 1
        for i, n in enumerate(self.nodes):
            what = n.act or (f"#{n.module}" if n.module >= 0 else "")
            lines.append(f"v{first + i} = {n.op}{what}({', '.join(f'v{a}' for a in n.args)})")
        lines.append(f"return {self.form} of {list(self.outputs)}" + (" + loss" if self.scalar else ""))
        return "; ".join(lines)


class RandomDag(nn.Module):
    """The module a `DagSpec` describes; forward interprets the node list."""

    def __init__(self, spec: DagSpec) -> None:
        super().__init__()
        self.spec = spec
        self.linears = nn.ModuleList(nn.Linear(i, o) for i, o in spec.linears)
        self.norms = nn.ModuleList(nn.BatchNorm1d(w) if kind == "bn" else nn.LayerNorm(w)
                                   for kind, w in spec.norms)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        vals = [x] if y is None else [x, y]
        for n in self.spec.nodes:
            a = vals[n.args[0]]
            if n.op == "linear":
                vals.append(self.linears[n.module](a))
            elif n.op == "act":
                vals.append(getattr(torch, n.act)(a) if n.act != "gelu"
                            else nn.functional.gelu(a))
            elif n.op == "add":
                vals.append(a + vals[n.args[1]])
            elif n.op == "mul":
                vals.append(a * vals[n.args[1]])
            elif n.op == "cat":
                vals.append(torch.cat([a, vals[n.args[1]]], dim=1))
            elif n.op == "add_":
                vals.append(a.add_(vals[n.args[1]]))
            elif n.op == "relu_":
                vals.append(a.relu_())
            else:  # bn, ln
                vals.append(self.norms[n.module](a))
        outs = [vals[i] for i in self.spec.outputs]
        if not self.spec.scalar:
            return outs[0] if self.spec.form == "tensor" else (
                tuple(outs) if self.spec.form == "tuple" else {f"out{k}": o for k, o in enumerate(outs)})
        loss = (outs[0] ** 2).mean()
        if self.spec.form == "tensor":
            return loss, outs[0]
        if self.spec.form == "tuple":
            return (loss, *outs)
        return {"loss": loss, **{f"out{k}": o for k, o in enumerate(outs)}}


@st.composite
def dag_specs(draw: st.DrawFn, max_nodes: int = 12, batchnorm: bool = True) -> DagSpec:
    """A random DagSpec: 2..max_nodes nodes over the inputs (see the module docstring)."""
    width = st.integers(4, MAX_WIDTH)
    in_width = draw(width)
    in2_width = draw(st.sampled_from([0, 0, in_width, draw(width)]))
    widths = [in_width] + ([in2_width] if in2_width else [])
    producer = ["input"] * len(widths)
    saved = [True] * len(widths)  # saved for backward by a reader (inputs: never written)
    dead = [False] * len(widths)
    grad = [False] * len(widths)  # depends on a parameter
    linears: list[tuple[int, int]] = []
    norms: list[tuple[str, int]] = []
    nodes: list[Node] = []
    kinds = ["linear", "linear", "act", "add", "mul", "cat", "add_", "relu_", "ln"]
    kinds += ["bn"] if batchnorm else []
    for _ in range(draw(st.integers(2, max_nodes))):
        live = [v for v in range(len(widths)) if not dead[v]]
        op = draw(st.sampled_from(kinds))
        a = draw(st.sampled_from(live))
        node: Node | None = None
        if op == "linear":
            reusable = [m for m, (i, _) in enumerate(linears) if i == widths[a]]
            if reusable and draw(st.booleans()):
                m = draw(st.sampled_from(reusable))  # shared parameters
            else:
                linears.append((widths[a], draw(width)))
                m = len(linears) - 1
            node, w = Node("linear", (a,), module=m), linears[m][1]
        elif op == "act":
            node, w = Node("act", (a,), act=draw(st.sampled_from(ACTIVATIONS))), widths[a]
        elif op in ("add", "mul"):
            b = draw(st.sampled_from([v for v in live if widths[v] == widths[a]]))
            node, w = Node(op, (a, b)), widths[a]
        elif op == "cat":
            b = draw(st.sampled_from(live))
            if widths[a] + widths[b] <= 2 * MAX_WIDTH:
                node, w = Node("cat", (a, b)), widths[a] + widths[b]
        elif op in ("add_", "relu_"):
            targets = [v for v in live if not saved[v] and producer[v] in _INPLACE_OK]
            if targets:
                t = draw(st.sampled_from(targets))
                if op == "add_":
                    others = [v for v in live if v != t and widths[v] == widths[t]]
                    if others:
                        node = Node("add_", (t, draw(st.sampled_from(others))))
                else:
                    node = Node("relu_", (t,))
                if node is not None:
                    dead[t] = True
                    w = widths[t]
        else:  # bn, ln: a module of their own each (a BatchNorm's statistics are per use)
            norms.append((op, widths[a]))
            node, w = Node(op, (a,), module=len(norms) - 1), widths[a]
        if node is None:
            continue
        for k, v in enumerate(node.args):
            if node.op not in _KEEPS_NO_INPUT or (node.op == "add_" and k == 0):
                saved[v] = True
        nodes.append(node)
        widths.append(w)
        producer.append(node.op)
        saved.append(False)
        dead.append(False)
        grad.append(node.op in ("linear", "bn", "ln") or any(grad[v] for v in node.args))
    first = 2 if in2_width else 1
    live_nodes = [v for v in range(first, len(widths)) if not dead[v]]
    if not any(grad[v] for v in live_nodes):  # nothing to train yet: end in a Linear
        src = live_nodes[-1] if live_nodes else 0
        linears.append((widths[src], draw(width)))
        nodes.append(Node("linear", (src,), module=len(linears) - 1))
        widths.append(linears[-1][1])
        live_nodes.append(len(widths) - 1)
        grad.append(True)
    last = [v for v in live_nodes if grad[v]][-1]  # returned: the deepest trainable value
    extra = draw(st.lists(st.sampled_from(live_nodes), max_size=2, unique=True))
    outputs = tuple([last] + [v for v in extra if v != last])
    form = "tensor" if len(outputs) == 1 and draw(st.booleans()) else draw(
        st.sampled_from(["tuple", "dict"]))
    if form == "tensor":
        outputs = outputs[:1]
    return DagSpec(in_width=in_width, in2_width=in2_width, y_by_keyword=draw(st.booleans()),
                   linears=tuple(linears), norms=tuple(norms), nodes=tuple(nodes),
                   outputs=outputs, form=form, scalar=draw(st.booleans()))


def make_inputs(spec: DagSpec, batch: int, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for one call on a batch of `batch` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, spec.in_width, generator=g)
    if not spec.in2_width:
        return (x,), {}
    y = torch.randn(batch, spec.in2_width, generator=g)
    return ((x,), {"y": y}) if spec.y_by_keyword else ((x, y), {})


def build(spec: DagSpec, seed: int = 0) -> RandomDag:
    torch.manual_seed(seed)
    return RandomDag(spec)


def user_loss(out: Any, ignore_last: bool = False) -> torch.Tensor:
    """A scalar from every output leaf (all but the last with `ignore_last`), different
    weights per leaf so that every output's gradient matters: the scalar loss itself, and a
    weighted mean of each batch tensor."""
    leaves = list(out.values()) if isinstance(out, dict) else (
        list(out) if isinstance(out, tuple) else [out])
    total = torch.zeros(())
    for k, t in enumerate(leaves[:-1] if ignore_last else leaves):
        total = total + (t if t.dim() == 0 else (t * (k + 1.0)).sin().mean())
    return total
