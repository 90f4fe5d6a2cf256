"""One microbatch's backward in two passes: B, the gradients of the stage inputs (what the
previous stage waits for), then W, the gradients of the weights (what nobody waits for, so a
zero-bubble schedule runs it in an idle slot later; Qi et al. 2023).

B runs autograd from the stage outputs to the stage inputs only, keeping the graph. The nodes
where a weight's gradient path joins that input path ("meeting nodes") get a pre-hook that
keeps the gradient flowing into them. W then runs autograd from those nodes, with the kept
gradients, to the weights only. Each weight's gradient is the same sum of the same terms as
in one full backward, so the results are equal (bit for bit on CPU in the tests), and W
accumulates into `.grad` through the weights' AccumulateGrad nodes, so post-accumulate-grad
hooks (the bucketed gradient reducer's, `rannc.pipeline.grads`) fire as after a full backward,
once per W call.

Two details make W exact. A meeting node may lie on the input side of another one, so W's
flow from the later node would reach it again on top of its kept gradient; a pre-hook during
W replaces whatever arrives with the kept gradient (what torch.distributed.pipelining's
`stage_backward_weight` does). And a weight whose path reaches the outputs without meeting
the input path (the first stage, whose inputs need no gradient; a weight feeding an output
directly) gets the output and its gradient as a root of W instead; nothing on the input path
lies below such an output, so no term is counted twice.

The graph stays alive from B to W (the weight gradients read the layers' inputs): a microbatch
holds its activations until its W, which is what the planner's memory model counts
(`rannc.schedule.in_flight`).

Written after torch.distributed.pipelining's `_backward.py` (`stage_backward_input`,
`stage_backward_weight`), with one W call per pass (so a weight gets one accumulation per
pass, as the reducer counts) and the outputs as roots where nothing meets.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_Grads = tuple[torch.Tensor | None, ...]


@dataclass
class WeightPass:
    """What B leaves for W: roots (graph edges with their gradients) and the weights."""

    roots: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    kept: dict[Node, _Grads] = field(default_factory=dict)  # meeting node -> gradient into it

    def run(self) -> None:
        """Accumulate the weights' gradients into `.grad` (once per weight), and free the graph."""
        if not self.roots or not self.weights:
            self.kept.clear()
            return
        handles = [node.register_prehook(lambda _g, k=kept: k)
                   for node, kept in self.kept.items()]
        try:
            torch.autograd.backward(self.roots, self.grads, inputs=self.weights)
        finally:
            for h in handles:
                h.remove()
            self.roots, self.grads, self.weights = [], [], []
            self.kept.clear()


def backward_input(outputs: Sequence[object], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> WeightPass:
    """B: accumulate into `inputs[i].grad` (leaves) the gradient of the outputs that have both a
    graph and a gradient; return the W pass that gives `weights` theirs."""
    outs: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    for o, g in zip(outputs, grads, strict=True):
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            gs.append(g)
    wanted = [x for x in inputs if x.requires_grad]
    ws = [w for w in weights if w.requires_grad]
    if not outs:
        return WeightPass()
    out_edges = [get_gradient_edge(o) for o in outs]
    consumers = _consumers([e.node for e in out_edges])
    on_path = _closure([get_gradient_edge(x).node for x in wanted], consumers)
    w_nodes = {get_gradient_edge(w).node for w in ws}
    meeting, root_outs = _meeting_nodes(w_nodes, on_path, consumers, out_edges)
    kept: dict[Node, _Grads] = {}
    handles = [node.register_prehook(lambda g, n=node: kept.__setitem__(n, tuple(g)))
               for node in meeting]
    try:
        if wanted:
            torch.autograd.backward(outs, gs, inputs=wanted, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    wp = WeightPass(weights=[w for w in ws if get_gradient_edge(w).node in consumers])
    for node, got in kept.items():
        for i, g in enumerate(got):
            if g is not None:
                wp.roots.append(GradientEdge(node, i))
                wp.grads.append(g)
    wp.kept = {n: g for n, g in kept.items()}
    for i in root_outs:
        wp.roots.append(out_edges[i])
        wp.grads.append(gs[i])
    return wp


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below `roots` -> the nodes whose backward feeds it (the edges
    reversed), by a walk from the roots."""
    out: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    todo = collections.deque(roots)
    while todo:
        node = todo.popleft()
        out.setdefault(node, [])
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return out


def _closure(starts: Sequence[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which some of `starts` is reached (the input path): `starts` and
    everything consuming them, transitively."""
    out = {n for n in starts if n in consumers}
    todo = collections.deque(out)
    while todo:
        for c in consumers.get(todo.popleft(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _meeting_nodes(w_nodes: set[Node], on_path: set[Node], consumers: dict[Node, list[Node]],
                   out_edges: Sequence[GradientEdge]) -> tuple[set[Node], list[int]]:
    """Walking from the weights toward the outputs: the input-path nodes first reached, and
    the outputs (by index) reached off the input path, which become W's roots (W sums the
    flows from every root, as one full backward from all the outputs does)."""
    meeting: set[Node] = set()
    seen: set[Node] = set()
    todo = collections.deque(n for n in w_nodes if n in consumers)
    while todo:
        for c in consumers.get(todo.popleft(), []):
            if c in on_path:
                meeting.add(c)
            elif c not in seen:
                seen.add(c)
                todo.append(c)
    roots = [i for i, e in enumerate(out_edges) if e.node in seen or e.node in w_nodes]
    return meeting, roots


__all__ = ["WeightPass", "backward_input"]
