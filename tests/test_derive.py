"""A graph captured again on a deployed model (another mode or input shape) is placed on the
deployed stages (`rannc.derive`): where its components go, and what each stage keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conformance import zoo

import rannc
from rannc.atomic.components import AtomicPartition, atomic_components
from rannc.derive import derive_plan
from rannc.graph.capture import capture
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan

pytestmark = pytest.mark.layer("pure")


def _planned_and_reshaped(name: str) -> tuple[Plan, TaskGraph, AtomicPartition, Plan]:
    """The zoo model's plan on 4 ranks (replicas [2, 1, 1], zero bubble), and the graph of its
    shorter sequences (`Case.reshaped`) with its components and its placement on that plan."""
    torch.manual_seed(0)
    case = getattr(zoo, name)()
    assert case.reshaped is not None
    plan = rannc.plan(case.model, (), case.batch(10),
                      cluster=rannc.Cluster.homogeneous(n=4, per_node=4),
                      config=rannc.Config(replicas=[2, 1, 1], microbatches=4,
                                          schedule="zero_bubble", profiler="estimate"))
    g = capture(case.model, (), case.reshaped(4)).graph
    atomic = atomic_components(g)
    return plan, g, atomic, derive_plan(g, atomic, plan)


@pytest.mark.parametrize("name", ["bart", "albert"])
def test_a_new_sequence_length_keeps_every_holder_of_a_tied_weight(name: str) -> None:
    """BART's shared embedding (encoder, decoder, head) and ALBERT's one layer shared by every
    layer are read on several stages. The graph of a shorter sequence put the decoder's
    embedding (ALBERT's next layers) on the first stage holding the weight, and each stage
    kept only the parameters its new components read: the tied weight's gradient was summed
    over fewer ranks than hold it, and the others stepped their copies without it (wrong
    gradients, copies drifting apart; found with rannc.check on 4 ranks, replicas [2, 1, 1]).
    Every stage now keeps what it holds; its gradient counts zero where nothing reads it."""
    plan, _, _, derived = _planned_and_reshaped(name)
    assert derived.holders() == plan.holders()
    assert [st.param_names for st in derived.stages] == [st.param_names for st in plan.stages]
    # the base plan reads the tied weight on more than one stage: the case this is about
    tied = [n for n, s in plan.holder_stages().items() if len(s) > 1]
    assert tied, plan.holder_stages()


@pytest.mark.parametrize("name", ["bert", "albert", "bart"])
def test_a_new_sequence_length_runs_each_op_on_the_stage_planned_for_it(name: str) -> None:
    """Work without parameters followed its inputs to the earliest stage: with sequences 4
    tokens shorter, BERT's three stages ran 32, 29 and 16 components where the plan had 26, 28
    and 23. Each component now starts from the stage the plan ran the same op of the same
    module on."""
    plan, g, atomic, derived = _planned_and_reshaped(name)
    assert [len(st.components) for st in derived.stages] == \
        [len(st.components) for st in plan.stages]
    # a plan without its graph (loaded from a file) still places it, from the earliest stage
    loaded = derive_plan(g, atomic, dataclasses.replace(plan, source=None))
    assert sum(len(st.components) for st in loaded.stages) == len(atomic.components)
