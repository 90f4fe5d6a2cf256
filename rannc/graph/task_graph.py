"""The task graph: rannc's ONNX-like view of a captured model.

There are two kinds of node, as in the paper (section III-A): *tasks* (one ATen
operation each, multi-output operations included) and *values* (what tasks
read and write). The graph is plain data, with no reference to torch.fx, so the
planner, the native code and the ONNX exporter can all read it, and a Plan can
be checked against it through `fingerprint()`.

Vocabulary: a value's *batch dim* is the tensor dimension that grows with the
batch; `batch_scale` is how many rows of that dim one sample owns (16 for a
`(B*16, V)` view of a `(B, 16, V)` tensor), so rows of a microbatch stay
contiguous. A value with `batch_dim=None` does not depend on the batch size
(a parameter, or a batch-reduced scalar such as a mean loss).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The op of capture's write-back tasks: a buffer's new value stored into the buffer (the only
# in-place writes a captured graph keeps; see rannc.graph.capture).
WRITE_BACK_OP = "rannc.write_back"
# Functionalisation's copy (src's values in dst's layout), made differentiable by capture.
COPY_OP = "rannc.copy"
# Ops that read only a tensor's sizes: a stage whose every read of a value is one of these needs
# its shape, never its rows (torch.export reads a batch size through whichever input carries
# the symbol, so such a read can land in any stage). Not strides or storage offsets: the
# stand-in a stage gets instead has a shape alone (`Transport.stand_in`).
SHAPE_OPS = frozenset({"aten.sym_size.int", "aten.sym_size.default", "aten.sym_numel.default"})


class ValueKind(enum.Enum):
    INPUT = "input"  # a tensor (or number) the user passes to the model
    PARAM = "param"  # an nn.Parameter
    BUFFER = "buffer"  # a registered buffer (e.g. BatchNorm running statistics)
    CONSTANT = "constant"  # a tensor constant lifted from the model's code, or a constant task's output
    ACTIVATION = "activation"  # produced by a non-constant task: depends on the inputs


@dataclass(frozen=True, slots=True)
class Value:
    name: str
    kind: ValueKind
    shape: tuple[int | str, ...]  # symbolic sizes are strings such as "16*batch"
    dtype: str  # "float32", ..., or "sym_int" for a symbolic size
    batch_dim: int | None = None
    batch_scale: int = 1
    producer: str | None = None  # the task writing it; None for graph inputs
    target: str | None = None  # parameter/buffer name, or the input's path in (args, kwargs)
    sym_expr: str | None = None  # for dtype "sym_int": its size expression in `batch`

    @property
    def is_tensor(self) -> bool:
        return self.dtype != "sym_int"

    def numel(self, batch: int = 1) -> int:
        n = 1
        for d in self.shape:
            n *= eval_dim(d, batch)
        return n


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    op: str  # e.g. "aten.linear.default"
    inputs: tuple[str, ...]  # value names, in first-use order, without repeats
    outputs: tuple[str, ...]
    module_path: str = ""  # the user's module that issued the op, e.g. "bert.encoder.layer.3"
    mutates: tuple[str, ...] = ()  # inputs written in place (BatchNorm statistics, add_)


@dataclass(slots=True)
class TaskGraph:
    """Tasks in a topological order, the values they connect, and the graph's interface."""

    tasks: list[Task]
    values: dict[str, Value]
    inputs: list[str]  # user input values, in pytree-flattened order of (args, kwargs)
    outputs: list[str | None]  # user output values in flattened order (None: not a value)
    _task_index: dict[str, int] = field(default_factory=dict, repr=False)
    _consumers: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._task_index = {t.name: i for i, t in enumerate(self.tasks)}
        consumers: dict[str, list[int]] = {v: [] for v in self.values}
        for i, t in enumerate(self.tasks):
            for v in t.inputs:
                consumers[v].append(i)
        self._consumers = consumers

    # -- lookups -------------------------------------------------------------
    def task_index(self, name: str) -> int:
        return self._task_index[name]

    def consumers(self, value: str) -> list[int]:
        """Indices of the tasks reading `value`."""
        return self._consumers[value]

    def producer(self, value: str) -> int | None:
        p = self.values[value].producer
        return None if p is None else self._task_index[p]

    def values_of_kind(self, kind: ValueKind) -> list[str]:
        return [n for n, v in self.values.items() if v.kind is kind]

    def edges(self, tensors_only: bool = False) -> list[tuple[int, int]]:
        """Task-to-task data dependencies (producer index, consumer index), without repeats;
        `tensors_only`: leave out the dependencies through symbolic sizes."""
        out: set[tuple[int, int]] = set()
        for j, t in enumerate(self.tasks):
            for v in t.inputs:
                i = self.producer(v)
                if i is not None and (not tensors_only or self.values[v].is_tensor):
                    out.add((i, j))
        return sorted(out)

    # -- identity ------------------------------------------------------------
    def to_json(self) -> dict[str, object]:
        return {
            "tasks": [
                [t.name, t.op, list(t.inputs), list(t.outputs), t.module_path, list(t.mutates)]
                for t in self.tasks
            ],
            "values": [
                [v.name, v.kind.value, [str(d) for d in v.shape], v.dtype, v.batch_dim,
                 v.batch_scale, v.producer, v.target, v.sym_expr]
                for v in self.values.values()
            ],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }

    def fingerprint(self) -> str:
        """A hash of the graph's structure, shapes and names; a saved Plan records it."""
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def content_fingerprint(self) -> str:
        """A hash of what the graph computes, free of the order its tasks were traced in and of
        the names tracing gave them: the sorted tasks, each as its op, module and the shapes and
        dtypes it reads and writes. Two graphs with equal fingerprints also have equal content
        fingerprints; equal content fingerprints and different fingerprints mean the same
        operations traced in another order (`rannc.validate.agree_on_graph` says so)."""
        def shape(v: str) -> list[str]:
            val = self.values[v]
            return [val.dtype, *[str(d) for d in val.shape]]

        rows = sorted(json.dumps([t.op, t.module_path, [shape(v) for v in t.inputs],
                                  [shape(v) for v in t.outputs]]) for t in self.tasks)
        return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for v in self.values.values():
            kinds[v.kind.value] = kinds.get(v.kind.value, 0) + 1
        ks = ", ".join(f"{k}={n}" for k, n in sorted(kinds.items()))
        return f"TaskGraph({len(self.tasks)} tasks, {len(self.values)} values: {ks})"


def eval_dim(dim: int | str, batch: int) -> int:
    """A size at a given batch: ints as they are, symbolic sizes ("16*batch") evaluated."""
    return dim if isinstance(dim, int) else _eval_sym(dim, batch)


@functools.lru_cache(maxsize=4096)
def _eval_sym(expr: str, batch: int) -> int:
    # Cached: a graph has a handful of distinct expressions, evaluated for every value and
    # microbatch, and sympify costs about 100 us.
    import sympy

    e = sympy.sympify(expr)
    # A size computed from tensor values (u0, ...: rannc.graph.capture._sym) has no value here;
    # costs and memory estimate it as the batch, as they did before it had its own symbol
    # (it never crosses a stage boundary, so no stage sizes a received value by it).
    return int(e.subs({s: batch for s in e.free_symbols}))


def topological_order(n: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    """Kahn's algorithm, smallest index first (so an already ordered graph keeps its order).

    The reference for the native `rannc._C.topological_order`.
    """
    import heapq

    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != n:
        raise ValueError(f"the graph has a cycle: {n - len(order)} of {n} nodes are on or after one")
    return order


def forward_reachable(n: int, edges: Sequence[tuple[int, int]], sources: Iterable[int]) -> list[bool]:
    """Which nodes are reachable from `sources` (sources included).

    The reference for the native `rannc._C.forward_reachable`.
    """
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
    seen = [False] * n
    stack = [s for s in sources]
    for s in stack:
        seen[s] = True
    while stack:
        i = stack.pop()
        for j in succ[i]:
            if not seen[j]:
                seen[j] = True
                stack.append(j)
    return seen
