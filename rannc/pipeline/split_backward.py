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

W must not redo B's work. One autograd call from every meeting node to every weight would
walk down the input path too (from a later meeting node to an earlier one, every input-gradient
node between them is on a path to a weight), recomputing most of B only to throw it away: a
stand-in whose input and weight gradients sleep measured W as long as B + W. So W runs one call
per group of roots that reach common weights through weight-side nodes alone
(torch.distributed.pipelining's parameter groups), each asking for its group's weights only:
autograd then runs just the nodes between those roots and those weights.

Two details make W exact. Within a group a meeting node may still lie on the input side of
another one (a weight used twice, as a tied embedding and head), so W's flow from the later
node would reach it again on top of its kept gradient; a pre-hook during W replaces whatever
arrives with the kept gradient (what torch.distributed.pipelining's `stage_backward_weight`
does). And a weight whose path reaches the outputs without meeting the input path (the first
stage, whose inputs need no gradient; a weight feeding an output directly) gets the output and
its gradient as a root of W instead; nothing on the input path lies below such an output, so
no term is counted twice.

The graph stays alive from B to W (the weight gradients read the layers' inputs), but what
only B reads does not: once B has run, the saved tensors of the input-path nodes W will not
walk (all but the meeting nodes, and those between two roots of one group) are released, as
the zero-bubble paper's runtime frees them (a softmax's output, a GELU's input, attention's
q, k and v, dropout masks; the layers' inputs stay, read by the meeting nodes). A microbatch
between B and W then holds what W reads and the kept gradients, which the planner's memory
model counts (`rannc.profile.saved.b_only`, `rannc.stage_dp.memory`). A saved tensor is
released by giving it pack/unpack hooks (`SavedTensor.register_hooks`) whose pack drops it: a
tensor saved under saved-tensor hooks already (selective recomputation's recipes) has its own
and stays until the graph is dropped, as do all with hooks active during B (below).

The input-path nodes W does not walk drop the rest of what they keep when the graph is
dropped, which is at once, except where saved-tensor hooks keep the saved tensor itself
(`saved_tensors_hooks(lambda t: t, ...)`, `save_on_cpu` on a CPU tensor): the tensor refers to
its node, a cycle through C++ that only a walk releasing the node breaks. When such hooks are
active during B, W is therefore one call from every root to every weight, walking the input
path again (slower, as before the groups, but nothing kept), and nothing is released after B.

Written after torch.distributed.pipelining's `_backward.py` (`stage_backward_input`,
`stage_backward_weight`), with every weight in exactly one group (so a weight gets one
accumulation per pass, as the reducer counts) and the outputs as roots where nothing meets.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    """Roots (graph edges with their gradients) that reach the same weights, and those weights."""

    roots: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)


@dataclass
class WeightPass:
    """What B leaves for W: groups of roots with their weights."""

    groups: list[_Group] = field(default_factory=list)
    kept: dict[Node, _Grads] = field(default_factory=dict)  # meeting node -> gradient into it

    def run(self) -> None:
        """Accumulate the weights' gradients into `.grad` (once per weight), and free the graph."""
        groups = [g for g in self.groups if g.roots and g.weights]
        handles = [node.register_prehook(lambda _g, k=kept: k)
                   for node, kept in self.kept.items()]
        try:
            for i, g in enumerate(groups):
                # the graph's buffers stay until the last call: a group's walk may pass nodes
                # another group needs (a tied weight's path through the input side)
                torch.autograd.backward(g.roots, g.grads, inputs=g.weights,
                                        retain_graph=i < len(groups) - 1)
        finally:
            for h in handles:
                h.remove()
            self.groups = []
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
    hooked = _saved_tensor_hooks_active()
    kept: dict[Node, _Grads] = {}
    handles = [node.register_prehook(lambda g, n=node: kept.__setitem__(n, tuple(g)))
               for node in meeting]
    try:
        if wanted:
            torch.autograd.backward(outs, gs, inputs=wanted, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    roots: list[tuple[GradientEdge, torch.Tensor]] = []
    for node, got in kept.items():
        roots += [(GradientEdge(node, i), g) for i, g in enumerate(got) if g is not None]
    roots += [(out_edges[i], gs[i]) for i in root_outs]
    reached = {get_gradient_edge(w).node: w for w in ws if get_gradient_edge(w).node in consumers}
    if hooked:  # one walk over everything, releasing every node (see the module docstring)
        one = _Group([e for e, _ in roots], [g for _, g in roots], list(reached.values()))
        return WeightPass(groups=[one], kept=kept)
    groups = _groups(roots, reached, on_path)
    if wanted:
        release_saved(on_path - meeting - _walked_by_w(groups, on_path, consumers))
    return WeightPass(groups=groups, kept=kept)


def _walked_by_w(groups: Sequence[_Group], on_path: set[Node],
                 consumers: dict[Node, list[Node]]) -> set[Node]:
    """The input-path nodes some W call runs: those between two meeting nodes of one group
    (a weight read twice, as a tied embedding and head), where the later one's flow reaches
    the earlier one's weights through the input path."""
    out: set[Node] = set()
    for g in groups:
        starts = {e.node for e in g.roots if e.node in on_path}
        if len(starts) < 2:
            continue
        below: set[Node] = set()
        todo = list(starts)
        while todo:
            for nxt, _ in todo.pop().next_functions:
                if nxt is not None and nxt in on_path and nxt not in below:
                    below.add(nxt)
                    todo.append(nxt)
        out |= below & _closure(list(starts), consumers)
    return out


def _dropped(_t: torch.Tensor) -> None:
    return None


def _gone(_packed: None) -> torch.Tensor:
    raise RuntimeError("rannc: a tensor saved for backward was released after the input pass "
                       "(B) and read again by the weight pass (W); this is a bug in rannc's "
                       "split backward, please report it with the model")


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def release_saved(nodes: Collection[Node]) -> int:
    """Release what `nodes` saved for backward (they must never run again); returns how many
    saved tensors were released. One without hooks of its own gets hooks that drop it, which
    frees its storage unless something else refers to it (another node that keeps it, a live
    output); one packed by saved-tensor hooks, or already released, stays as it is."""
    n = 0
    for node in nodes:
        attrs = _SAVED_ATTRS.get(type(node))
        if attrs is None:
            attrs = _SAVED_ATTRS[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        for a in attrs:
            try:
                got = getattr(node, a)
            except RuntimeError:  # (released already)
                continue
            for sv in got if isinstance(got, (list, tuple)) else (got,):
                try:
                    sv.register_hooks(_dropped, _gone)
                    n += 1
                except (RuntimeError, AttributeError):  # hooks of its own, None, or released
                    pass
    return n


def _saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks are set (`torch.autograd.graph.saved_tensors_hooks`);
    True where this torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _groups(roots: Sequence[tuple[GradientEdge, torch.Tensor]], weights: dict[Node, torch.Tensor],
            on_path: set[Node]) -> list[_Group]:
    """Roots joined when they reach a common weight through nodes off the input path; each
    group with the weights its roots reach so (every weight in one group: those reached)."""
    owner: dict[Node, int] = {}  # weight node -> the group (index into `parent`) holding it
    parent = list(range(len(roots)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (edge, _) in enumerate(roots):
        # below a meeting node, only its weight-side edges; the input side is B's
        todo = [n for n, _ in edge.node.next_functions if n is not None and n not in on_path]
        if edge.node not in on_path:  # an output reached off the input path
            todo = [edge.node]
        seen: set[Node] = set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in weights:
                j = owner.setdefault(node, i)
                parent[find(i)] = find(j)
            todo += [n for n, _ in node.next_functions if n is not None and n not in on_path]
    out: dict[int, _Group] = {}
    for i, (edge, g) in enumerate(roots):
        grp = out.setdefault(find(i), _Group())
        grp.roots.append(edge)
        grp.grads.append(g)
    for node, w in weights.items():
        if node in owner:
            out[find(owner[node])].weights.append(w)
    return list(out.values())


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


__all__ = ["WeightPass", "backward_input", "release_saved"]
