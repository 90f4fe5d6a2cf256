"""Phase 1 (paper III-A): atomic components.

A task is *non-constant* when its output depends on a model input (it is
reachable from one); otherwise it is *constant* (it reads only parameters,
buffers and constants). Every atomic component holds exactly one non-constant
task plus the constant tasks that feed it, so that a stage made of components
always depends on the input: replicating a stage that only transposes weights
would waste devices.

The paper's procedure walks the graph backwards from the outputs: a
non-constant task opens a new component; a constant task joins the component
its output goes to, and when its output goes to several components it is
*cloned* into each of them (together with its constant predecessors, which
then also feed several components). Two cases the paper does not meet, and
what we do:
- a constant task whose result no component reads (an in-place update such
  as BatchNorm's `num_batches_tracked.add_(1)`, or a constant model output)
  joins one component: the nearest non-constant task of the same module,
  else the next non-constant task in topological order, else the last one;
- a constant task that writes a graph input in place (a buffer) is never
  cloned (the update must happen once): it joins the first component that
  reads it, and the others read its result from there. One that writes a
  tensor a constant task made (`torch.tensor(...)` in forward is
  `detach_(lift_fresh_copy(c))`) is cloned with its producer like any other
  constant task: each stage makes and writes its own copy (kept once, its
  result would have to cross stages, which constants never do);
- a non-constant *write-back* (capture's store of a new value into a
  buffer, e.g. BatchNorm's running statistics) opens no component: it joins
  the component of the task computing the new value, so the stage holding
  that task updates the buffer and the value never crosses a boundary.

Index conventions: t, u index `graph.tasks`; c indexes components.
"""

from __future__ import annotations

from dataclasses import dataclass

from rannc.graph.native import forward_reachable
from rannc.graph.task_graph import WRITE_BACK_OP, TaskGraph, ValueKind


@dataclass(frozen=True, slots=True)
class AtomicComponent:
    index: int
    task: int  # its non-constant task
    constant_tasks: tuple[int, ...]  # constant tasks folded in, in topological order
    write_backs: tuple[int, ...] = ()  # non-constant buffer write-backs folded in

    @property
    def tasks(self) -> tuple[int, ...]:
        """All its tasks in topological order."""
        return tuple(sorted((*self.constant_tasks, *self.write_backs, self.task)))


@dataclass(frozen=True, slots=True)
class AtomicPartition:
    components: tuple[AtomicComponent, ...]  # in topological order of their non-constant task
    component_of: tuple[int, ...]  # per task: its component (a write-back: its producer's),
    # or -1 for a constant task
    holders: tuple[tuple[int, ...], ...]  # per task: the components that hold a copy of it

    @property
    def cloned_tasks(self) -> list[int]:
        """Constant tasks held by more than one component."""
        return [t for t, h in enumerate(self.holders) if len(h) > 1]

    def component_edges(self, graph: TaskGraph) -> list[tuple[int, int]]:
        """Dependencies between components (from, to), without repeats or self-loops: data,
        and a buffer's readers before the component storing its new value (a write-back has
        no data edge from the readers of the old value; run first, it would change what they
        read). Only such orders already forward in component order are added, so the edges
        stay acyclic; a split the other way is refused on several ranks at deployment."""
        out: set[tuple[int, int]] = set()
        for comp in self.components:
            for u in comp.tasks:
                for v in graph.tasks[u].inputs:
                    p = graph.producer(v)
                    if p is None or comp.index in self.holders[p]:
                        continue
                    out.add((self.holders[p][0], comp.index))
            for t in comp.write_backs:
                buf = graph.tasks[t].inputs[0]
                for u in graph.consumers(buf):
                    out.update((c, comp.index) for c in self.holders[u] if c < comp.index)
            # a write in place into a graph input (a buffer updated under no_grad, a counter's
            # add_): its other readers keep their order around it, before reading the old
            # value, after the new one
            for t in comp.tasks:
                for buf in graph.tasks[t].mutates:
                    if graph.values[buf].producer is not None:
                        continue
                    for u in graph.consumers(buf):
                        for c in self.holders[u]:
                            if c != comp.index:
                                out.add((c, comp.index) if c < comp.index else (comp.index, c))
        return sorted(out)


def non_constant_tasks(graph: TaskGraph) -> list[bool]:
    """Per task: reachable from a batched model input through tensors.

    A task that depends on the inputs only through their sizes (`arange(batch)`, a mask of
    the batch's shape) is constant: it is cloned into every stage that reads it and computed
    there for that stage's own rows. Received from another stage it would be wrong when the
    rows are regrouped between stages (replicas [2, 1]): `arange(batch)[:, None, None, None]`,
    which Hugging Face's mask functions use to pick each row's attention mask, would arrive
    as [0, 1, 0] for a 3-row microbatch made of a 2-row and a 1-row piece.

    So is a task that reads only inputs without a batch dimension (Hugging Face's
    `num_items_in_batch.to(device)`): every rank passes the same such input and every stage
    has it, while a batch-less value sent between stages cannot be split into rows (the
    runtime refuses it)."""
    n = len(graph.tasks)
    sources = sorted({c for v in graph.values_of_kind(ValueKind.INPUT)
                      if graph.values[v].batch_dim is not None for c in graph.consumers(v)})
    return forward_reachable(n, graph.edges(tensors_only=True), sources)


def atomic_components(graph: TaskGraph) -> AtomicPartition:
    """Form the atomic components of `graph` (the tasks must be in topological order)."""
    n = len(graph.tasks)
    nc = non_constant_tasks(graph)
    component_of = [-1] * n
    write_back_source = {t: p for t in range(n) if nc[t]
                         and (p := _write_back_source(graph, t)) is not None and nc[p]}
    nc_tasks = [t for t in range(n) if nc[t] and t not in write_back_source]
    if not nc_tasks:
        raise ValueError("the graph has no task that depends on a model input; nothing to partition")
    for c, t in enumerate(nc_tasks):
        component_of[t] = c
    write_backs: list[list[int]] = [[] for _ in nc_tasks]
    for t, p in write_back_source.items():  # a producer comes before its write-back
        component_of[t] = component_of[p]
        write_backs[component_of[p]].append(t)

    holders: list[set[int]] = [set() for _ in range(n)]
    for t in range(n):
        if nc[t]:
            holders[t].add(component_of[t])
    for t in reversed(range(n)):  # consumers come after producers, so they are settled first
        if nc[t]:
            continue
        targets: set[int] = set()
        for v in graph.tasks[t].outputs:
            for u in graph.consumers(v):
                targets |= holders[u]
        if not targets:
            targets = {_home_of_sink(graph, t, nc_tasks, component_of)}
        elif _writes_state(graph, t) and len(targets) > 1:
            targets = {min(targets)}
        holders[t] = targets

    constant_of: list[list[int]] = [[] for _ in nc_tasks]
    for t in range(n):
        if not nc[t]:
            for c in holders[t]:
                constant_of[c].append(t)
    components = tuple(
        AtomicComponent(index=c, task=t, constant_tasks=tuple(constant_of[c]),
                        write_backs=tuple(write_backs[c]))
        for c, t in enumerate(nc_tasks)
    )
    return AtomicPartition(
        components=components,
        component_of=tuple(component_of),
        holders=tuple(tuple(sorted(h)) for h in holders),
    )


def _writes_state(graph: TaskGraph, t: int) -> bool:
    """Whether task t writes in place into a graph input (a buffer, a lifted constant)."""
    return any(graph.values[v].producer is None for v in graph.tasks[t].mutates)


def _write_back_source(graph: TaskGraph, t: int) -> int | None:
    """For a write-back task (capture's `WRITE_BACK_OP`: a computed value stored into a
    buffer): the task computing the value; else None."""
    task = graph.tasks[t]
    if task.op != WRITE_BACK_OP or len(task.inputs) != 2:
        return None
    dst, src = task.inputs
    if task.mutates != (dst,) or graph.values[dst].kind is not ValueKind.BUFFER:
        return None
    return graph.producer(src)


def _home_of_sink(graph: TaskGraph, t: int, nc_tasks: list[int], component_of: list[int]) -> int:
    """The component for a constant task whose output no component reads."""
    path = graph.tasks[t].module_path
    same_module = [u for u in nc_tasks if graph.tasks[u].module_path == path] if path else []
    if same_module:
        return component_of[min(same_module, key=lambda u: abs(u - t))]
    later = [u for u in nc_tasks if u > t]
    return component_of[later[0] if later else nc_tasks[-1]]


def task_attributes(graph: TaskGraph, atomic: AtomicPartition) -> dict[str, dict[str, int | str]]:
    """Per task name, its atomic component as ONNX node attributes (`atomic_component`;
    a cloned constant task also lists every holder in `cloned_into`)."""
    attrs: dict[str, dict[str, int | str]] = {}
    for t, task in enumerate(graph.tasks):
        holders = atomic.holders[t]
        a: dict[str, int | str] = {"atomic_component": holders[0]}
        if len(holders) > 1:
            a["cloned_into"] = ",".join(map(str, holders))
        attrs[task.name] = a
    return attrs
