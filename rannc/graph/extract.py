"""Stage extraction: one executable fx module per group of atomic components.

A *cut* is an ordered list of groups of atomic components; it is valid when
every data dependency goes from a group to itself or to a later group (so the
groups are convex and can run one after another). Each group becomes a
`StageGraph` (pure data: its tasks and the values it takes and gives) and an
`fx.GraphModule` whose placeholders are the stage's inputs in order (model
inputs, parameters, buffers, constants, earlier stages' values) and whose
output is the tuple of the values later stages or the model's outputs need.

Cloned constant tasks (phase 1) run in every stage that holds them, so their
results never cross a stage boundary. Parameters stay inputs: the executor
passes the model's own tensors, so autograd accumulates into the user's
parameters and in-place buffer updates (BatchNorm statistics) land in the
user's buffers.

An in-place task (`add_`, `relu_`) on an activation is exact in the original model because
every reader of the old value runs before it in program order and the tensor is not an
autograd leaf. Across a stage boundary neither holds, so the stage module copies instead:
a stage that writes into one of its inputs writes into a clone of it (a received activation
is a leaf that requires grad, and the pipeline keeps stage inputs for recomputation), and a
stage that writes into a value it also sends sends a clone taken before the write (its
readers in later stages read the value as it was before the write).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from rannc.atomic.components import AtomicPartition
from rannc.errors import RaNNCError
from rannc.graph.group_check import check_ordered_groups
from rannc.graph.task_graph import TaskGraph, ValueKind


@dataclass(frozen=True, slots=True)
class StageGraph:
    index: int
    components: tuple[int, ...]
    tasks: tuple[int, ...]  # topological order; a cloned task may also be in other stages
    inputs: tuple[str, ...]  # values it reads but does not produce
    outputs: tuple[str, ...]  # values it produces that later stages or the model outputs need


def split_graph(graph: TaskGraph, atomic: AtomicPartition,
                groups: Sequence[Sequence[int]]) -> list[StageGraph]:
    """Check that `groups` is a valid cut and describe each group as a StageGraph."""
    n_comp = len(atomic.components)
    group_of = [-1] * n_comp
    for g, comps in enumerate(groups):
        for c in comps:
            if not 0 <= c < n_comp:
                raise RaNNCError(f"cut names atomic component {c}, but there are {n_comp}")
            if group_of[c] != -1:
                raise RaNNCError(f"atomic component {c} is in groups {group_of[c]} and {g}")
            group_of[c] = g
    missing = [c for c in range(n_comp) if group_of[c] == -1]
    if missing:
        raise RaNNCError(f"cut leaves out {len(missing)} atomic components, e.g. {missing[:5]}")
    bad = check_ordered_groups(n_comp, atomic.component_edges(graph), group_of)
    if bad is not None:
        a, b = bad
        ta, tb = graph.tasks[atomic.components[a].task], graph.tasks[atomic.components[b].task]
        raise RaNNCError(
            f"cut is not executable in order: component {a} ({ta.op} in '{ta.module_path}') "
            f"is in group {group_of[a]} but feeds component {b} ({tb.op} in "
            f"'{tb.module_path}') in earlier group {group_of[b]}; move one of them"
        )

    stage_tasks: list[list[int]] = []
    for comps in groups:
        ts = sorted({t for c in comps for t in atomic.components[c].tasks})
        stage_tasks.append(ts)
    produced_in: list[set[str]] = [
        {v for t in ts for v in graph.tasks[t].outputs} for ts in stage_tasks
    ]
    reads: list[list[str]] = []
    for g, ts in enumerate(stage_tasks):
        seen: dict[str, None] = {}
        for t in ts:
            for v in graph.tasks[t].inputs:
                if v not in produced_in[g]:
                    seen[v] = None
        reads.append(list(seen))
    # A value read by stage h comes from the latest earlier stage producing it
    # (a cloned constant task may produce it in several); a model output comes
    # from the last stage producing it.
    supplier: dict[tuple[str, int], int] = {}
    for h, vs in enumerate(reads):
        for v in vs:
            src = [g for g in range(h) if v in produced_in[g]]
            if src:
                supplier[(v, h)] = src[-1]
    gives: list[set[str]] = [set() for _ in groups]
    for (v, _h), g in supplier.items():
        gives[g].add(v)
    for out in graph.outputs:
        src = [g for g in range(len(groups)) if out is not None and out in produced_in[g]]
        if out is not None and src:
            gives[src[-1]].add(out)
    stages = []
    for g, ts in enumerate(stage_tasks):
        outs = [v for t in ts for v in graph.tasks[t].outputs if v in gives[g]]
        stages.append(StageGraph(index=g, components=tuple(groups[g]), tasks=tuple(ts),
                                 inputs=tuple(reads[g]), outputs=tuple(outs)))
    return stages


def check_buffer_writes_stay_in_one_stage(graph: TaskGraph, stages: Sequence[StageGraph]) -> None:
    """Each stage holds its own copy of the buffers it reads, so a buffer written in place in
    one stage and read in another would drift apart on different ranks (the reader keeps the
    value from before the first step). Raise naming the buffer and the stages.

    Not a limit of one process (every stage reads the user's one buffer): call it where the
    stages run on different ranks. BatchNorm never meets it (one task reads and writes)."""
    for st in stages:
        for t in st.tasks:
            for v in graph.tasks[t].mutates:
                val = graph.values[v]
                if val.kind is not ValueKind.BUFFER:
                    continue
                readers = [o.index for o in stages if o.index != st.index and v in o.inputs]
                if readers:
                    task = graph.tasks[t]
                    raise RaNNCError(
                        f"buffer '{val.target}' is updated in place in stage {st.index} (module "
                        f"'{task.module_path}') but also read in stage(s) {readers}, which would "
                        "keep a stale copy on their ranks. rannc does not synchronise buffers "
                        "between stages yet. Fix: force a layout that keeps the module reading "
                        "and updating it in one stage (partition_num, or a plan file), or keep "
                        "the update next to the read in forward()."
                    )


def build_stage_module(gm: fx.GraphModule, graph: TaskGraph, stage: StageGraph) -> fx.GraphModule:
    """An fx module computing `stage`: placeholders = stage.inputs, output = tuple(stage.outputs)."""
    old_nodes = {n.name: n for n in gm.graph.nodes}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = torch.nn.Module()
    for name in stage.inputs:
        p = new.placeholder(name)
        p.meta = dict(old_nodes[name].meta)
        env[old_nodes[name]] = p

    def arg(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # a higher-order op's subgraph
            setattr(root, str(n.target), getattr(gm, str(n.target)))
            env[n] = new.get_attr(str(n.target))
        return env[n]

    copied: dict[str, fx.Node] = {}  # written activations: their copy (see the docstring)
    for t in stage.tasks:
        node = old_nodes[graph.tasks[t].name]
        for v in graph.tasks[t].mutates:
            if graph.values[v].kind is not ValueKind.ACTIVATION or v in copied:
                continue
            if v not in stage.inputs and v not in stage.outputs:
                continue
            w = old_nodes[v]
            copied[v] = new.call_function(torch.ops.aten.clone.default, (env[w],))
            copied[v].meta = dict(w.meta)
            if v in stage.inputs:  # the stage and its readers from here on use the copy
                env[w] = copied[v]
            # (a value the stage sends goes out as it was before the write: see the output)
        env[node] = new.node_copy(node, arg)
        for u in node.users:
            if u.name in graph.values and graph.values[u.name].producer == node.name:
                env[u] = new.node_copy(u, arg)
    new.output(tuple(copied.get(v, env[old_nodes[v]]) for v in stage.outputs))
    new.lint()
    return fx.GraphModule(root, new, class_name=f"Stage{stage.index}")


def run_chain(modules: Sequence[fx.GraphModule], stages: Sequence[StageGraph],
              env: Mapping[str, Any]) -> dict[str, Any]:
    """Run the stages one after another in one process; returns every value computed."""
    values = dict(env)
    for mod, st in zip(modules, stages, strict=True):
        outs = mod(*[values[v] for v in st.inputs])
        values.update(zip(st.outputs, outs, strict=True))
    return values
