"""Where each value goes: which stage supplies every moved value, which stages read it, which
stage computes each model output, and along which edges gradients come back.

Fixed at deployment and the same on every rank (it reads only the graph and its cut into
stages), so a sender and a receiver agree on every transfer without asking each other; pure, so
it is tested without a process group. Which *rows* of a value go to which *rank* is the row
layout's business (`rows.RowLayout`, one per call); which message carries them is the
transport's (`transport.Key`).

A value *moves* when it is a tensor with a batch dimension that is a model input or an
activation: it travels as rows. Parameters, buffers and constants never move (every stage that
reads them holds them); values without a batch dimension cannot cross a stage boundary. A stage
that reads a moved value only for its sizes (`labels.size(0)` placed with the embeddings, say)
gets a stand-in of that shape instead of the rows (`shape_only`).

Index conventions: s, t stages (s the sender, t the reader; -1 the ranks owning a model
input's rows); v value names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rannc.errors import RaNNCError
from rannc.graph.extract import StageGraph
from rannc.graph.row_mixing import unsplittable
from rannc.graph.task_graph import SHAPE_OPS, TaskGraph, Value, ValueKind
from rannc.pipeline.transport import Channel, Kind

# The supplier of a model input: the ranks owning its rows, not a stage.
OWNERS = -1


def is_float(val: Value) -> bool:
    return val.is_tensor and getattr(torch, val.dtype).is_floating_point


class Routes:
    """The routes of one deployment: `graph` cut into `stages` (in pipeline order)."""

    def __init__(self, graph: TaskGraph, stages: Sequence[StageGraph]) -> None:
        self.graph = graph
        self.stages = list(stages)
        # (asked for every stage input and output of every action: decided once per value)
        self._moving = frozenset(
            v for v, val in graph.values.items()
            if val.is_tensor and val.batch_dim is not None
            and val.kind in (ValueKind.INPUT, ValueKind.ACTIVATION))
        self.out_stage = self._output_stages()  # model output -> the stage computing it
        # (v, t): stage t reads moved value v only for its sizes; no rows travel for it
        self._shape_only = frozenset(
            (v, t) for t, st in enumerate(self.stages) for v in st.inputs
            if v in self._moving and all(graph.tasks[i].op in SHAPE_OPS for i in st.tasks
                                         if v in graph.tasks[i].inputs))
        self._suppliers: dict[tuple[str, int], int] = {}  # (v, t) -> s
        self._consumers: dict[tuple[str, int], list[int]] = {}  # (v, s) -> [t, ...]
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                if self.receives(v, t):
                    s = self._find_supplier(v, t)
                    self._suppliers[(v, t)] = s
                    self._consumers.setdefault((v, s), []).append(t)
        self._edges_from: dict[frozenset[str], frozenset[tuple[str, int]]] = {}
        self.grad_edges, self.input_edges = self._gradient_edges()
        self._check_boundaries()

    # -- values --------------------------------------------------------------------------------
    def moves(self, v: str) -> bool:
        """Whether value v travels between stages as rows: a tensor input or activation with a
        batch dimension."""
        return v in self._moving

    def receives(self, v: str, t: int) -> bool:
        """Whether stage input v arrives at stage t as rows: moved, and not read only for its
        sizes."""
        return self.moves(v) and (v, t) not in self._shape_only

    def shape_only(self, v: str, t: int) -> bool:
        """Whether stage t reads moved value v only for its sizes (`SHAPE_OPS`): it gets a
        stand-in of v's shape (`Transport.stand_in`), no rows, and sends no gradient back."""
        return (v, t) in self._shape_only

    def is_float(self, v: str) -> bool:
        return is_float(self.graph.values[v])

    def is_activation(self, v: str) -> bool:
        """A float value received from an earlier stage: gradients flow back along it."""
        val = self.graph.values[v]
        return self.moves(v) and val.kind is ValueKind.ACTIVATION and is_float(val)

    def is_buffer(self, v: str) -> bool:
        return self.graph.values[v].kind is ValueKind.BUFFER

    def scalar_outputs(self) -> list[str]:
        """Model outputs without a batch dimension (a loss), in output order."""
        return [v for v in self.out_stage if self.graph.values[v].batch_dim is None]

    def one_scalar_loss(self) -> bool:
        """Whether the model returns exactly one floating-point scalar (what an eager schedule
        needs to seed its backward inside forward())."""
        floats = [v for v in self.out_stage if self.is_float(v)]
        return len([v for v in floats if self.graph.values[v].batch_dim is None]) == 1

    def has_batch_grad_outputs(self) -> bool:
        """Whether some float model output has rows (a gradient may come back for it)."""
        return any(self.is_float(v) and self.graph.values[v].batch_dim is not None
                   for v in self.out_stage)

    # -- edges ---------------------------------------------------------------------------------
    def supplier(self, v: str, t: int) -> int:
        """The stage that sends moved value v to stage t (OWNERS: a model input)."""
        return self._suppliers[(v, t)]

    def consumers(self, v: str, s: int) -> list[int]:
        """Stages that read moved value v from stage s (or from the input owners, s = OWNERS)."""
        return self._consumers.get((v, s), [])

    def stage_suppliers(self) -> list[list[int]]:
        """Per stage: the stages it receives activations from (what a schedule is built on)."""
        return [sorted({self.supplier(v, t) for v in st.inputs if self.receives(v, t)} - {OWNERS})
                for t, st in enumerate(self.stages)]

    def sends_grad_back(self, v: str, t: int, grad_inputs: frozenset[str]) -> bool:
        """Whether stage t sends the gradient of its input v back: always along an activation's
        gradient edge, and for a model input only in calls where that input requires grad."""
        return (v, t) in self.grad_edges or (v in grad_inputs and (v, t) in self.input_edges)

    def channels(self) -> list[Channel]:
        """Every (value, kind, stage) a message of some microbatch can carry, in a fixed order
        (the transport numbers its tags by it). FWD and GRAD name the reading stage, OUT and
        OUT_GRAD the stage computing the model output."""
        out = [Channel(v, Kind.FWD, t) for (v, t) in self._suppliers]
        out += [Channel(v, Kind.GRAD, t) for (v, t) in sorted(self.grad_edges | self.input_edges)]
        for v, s in self.out_stage.items():
            if self.graph.values[v].batch_dim is not None:
                out.append(Channel(v, Kind.OUT, s))
                out.append(Channel(v, Kind.OUT_GRAD, s))
        return sorted(set(out))

    def _find_supplier(self, v: str, t: int) -> int:
        if self.graph.values[v].kind is ValueKind.INPUT:
            return OWNERS
        for s in range(t - 1, -1, -1):
            if v in self.stages[s].outputs:
                return s
        raise RaNNCError(f"no stage before {t} supplies value {v}")

    def grad_edges_from(self, outputs: frozenset[str]) -> frozenset[tuple[str, int]]:
        """The activations' gradient edges (`grad_edges`) a backward seeded from the model
        outputs `outputs` alone sends along: those whose reading task has an output one of
        `outputs` depends on. Both ends of each edge know which outputs seed the pass (the
        ranks agree on it before it starts), so a value only an output the step leaves out
        reads (a side tower feeding an auxiliary loss) sends no zeros back, and its producer's
        parameters keep `.grad` None, as in PyTorch."""
        got = self._edges_from.get(outputs)
        if got is None:
            got = self._edges_from[outputs] = frozenset(self._edges(outputs) & self.grad_edges)
        return got

    def _edges(self, outputs: frozenset[str] | set[str]) -> set[tuple[str, int]]:
        """The moved float values (v, t) stage t has a task reading, with an output one of the
        model outputs `outputs` depends on."""
        g = self.graph
        live = {v for v in outputs if is_float(g.values[v])}
        for task in reversed(g.tasks):
            if any(o in live for o in task.outputs):
                live.update(v for v in task.inputs if is_float(g.values[v]))
        return {(v, t) for t, st in enumerate(self.stages) for i in st.tasks
                for v in g.tasks[i].inputs
                if v in st.inputs and self.receives(v, t) and is_float(g.values[v])
                and any(o in live for o in g.tasks[i].outputs)}

    def _gradient_edges(self) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        """The moved values (v, t) whose gradient stage t can send back: stage t has a task
        reading v with an output some float model output depends on. Both ends read this
        fixed set, so a value only a dead branch reads (a BatchNorm that no output uses, kept
        for its statistics) sends nothing back, and its producer's parameters keep `.grad`
        None as in the original model, where zeros would let weight decay move them.
        Returned apart: the activations', sent where the outputs seeding the backward depend
        on them (`grad_edges_from`), and the float model inputs', sent to the ranks owning the
        rows only in calls where those inputs require grad."""
        edges = self._edges(set(self.out_stage))
        acts = {(v, t) for v, t in edges if self.is_activation(v)}
        return acts, edges - acts

    def _output_stages(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.graph.outputs:
            if v is None or self.graph.values[v].dtype == "sym_int":
                continue  # (a size: the runtime gives its global value, `PipelineRuntime`)
            prods = [s for s, st in enumerate(self.stages) if v in st.outputs]
            if not prods:
                raise RaNNCError(f"model output {v} is not computed by any stage (it is a "
                                 f"{self.graph.values[v].kind.value}); return a computed tensor")
            out[v] = prods[-1]
        return out

    def _check_boundaries(self) -> None:
        cannot = unsplittable(self.graph)
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                if v in cannot and not self.shape_only(v, t):
                    raise RaNNCError(
                        f"value {v} ({self.graph.values[v].shape}) crosses into stage {t}, but "
                        f"{cannot[v]}, so it cannot be split by rows. Choose another "
                        "partition_num or cut")

    # -- parameters ----------------------------------------------------------------------------
    def first_use(self) -> dict[str, int]:
        """Per parameter name: the index of the first task reading it in the whole graph (the
        same on every rank: the gradient reducer's bucket order)."""
        out: dict[str, int] = {}
        for i, task in enumerate(self.graph.tasks):
            for v in task.inputs:
                val = self.graph.values[v]
                if val.kind is ValueKind.PARAM and val.target is not None:
                    out.setdefault(val.target, i)
        return out

    def reached_from(self, v: str) -> set[str]:
        """Every value computed (transitively) from value v, and v itself."""
        reached = {v}
        for task in self.graph.tasks:
            if any(x in reached for x in task.inputs):
                reached.update(task.outputs)
        return reached


__all__ = ["OWNERS", "Routes", "is_float"]
