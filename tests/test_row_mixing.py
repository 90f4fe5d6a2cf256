"""Batch values whose rows are not their samples' own never cross a stage boundary
(`rannc.graph.row_mixing`): found on Mixtral and Qwen2-MoE, whose grouped-experts path sorts the
whole batch's (token, expert) pairs; cut inside it on replicas [2, 1, 1], the second stage got
two replicas' permutations concatenated and indexed out of range (or the wrong tokens)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conformance import zoo

import rannc
from rannc.atomic.components import atomic_components
from rannc.derive import derive_plan
from rannc.errors import RaNNCError
from rannc.graph.capture import capture
from rannc.graph.extract import split_graph
from rannc.graph.row_mixing import row_mixed
from rannc.pipeline.routes import Routes

pytestmark = pytest.mark.layer("pure")


def _captured(name: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    case = getattr(zoo, name)()
    return case, capture(case.model, (), case.batch(4))


def test_sizes_from_tensor_values_are_not_the_batch_and_stay_in_their_stage() -> None:
    """JetMoE splits its sorted tokens by each expert's count (.tolist()): those counts are
    torch's unbacked sizes, which capture took for the batch size, so a stage cut after the
    router split by the row count ([4, 4, 4, 4] for 96 tokens: a crash, or with a matching sum
    the wrong tokens per expert). They keep their own symbols; what they size has no batch
    dimension; neither may cross a stage boundary."""
    from rannc.graph.row_mixing import unsplittable

    _, cap = _captured("jetmoe")
    g = cap.graph
    cannot = unsplittable(g)
    counts = [v for t in g.tasks if t.op == "aten.item.default" for v in t.outputs]
    assert counts
    for v in counts:
        assert g.values[v].sym_expr is not None and "batch" not in g.values[v].sym_expr
        assert "a size computed from tensor values" in cannot[v]
    pieces = [v for t in g.tasks if t.op == "aten.split_with_sizes.default" for v in t.outputs]
    assert pieces and all(g.values[v].batch_dim is None and v in cannot for v in pieces)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_an_experts_sort_is_mixed_and_its_unpermuted_output_is_not(name: str) -> None:
    _, cap = _captured(name)
    g = cap.graph
    mixed = row_mixed(g)
    sorts = [t for t in g.tasks if t.op == "aten.sort.default"]
    assert len(sorts) == 2  # one per layer's experts
    for t in sorts:
        assert set(t.outputs) <= mixed
    # the experts' result in token order (their module's last batch output) is not mixed,
    # nor is anything outside the experts but the positions from an arange
    experts = [t for t in g.tasks if t.module_path.endswith("mlp.experts")]
    assert experts[-1].outputs[0] not in mixed
    for v in mixed:
        task = g.tasks[g.producer(v)]
        assert ".experts" in task.module_path or g.values[v].dtype == "int64", (v, task)
    assert all(v not in mixed for v in g.outputs if v is not None)


def test_a_dense_model_has_only_positions_mixed() -> None:
    _, cap = _captured("llama")
    g = cap.graph
    assert all(g.values[v].dtype == "int64" for v in row_mixed(g))


def test_a_cut_across_a_mixed_value_is_refused_at_deployment() -> None:
    _, cap = _captured("mixtral")
    g = cap.graph
    atomic = atomic_components(g)
    sort_task = next(i for i, t in enumerate(g.tasks) if t.op == "aten.sort.default")
    c = atomic.component_of[sort_task]
    n = len(atomic.components)
    with pytest.raises(RaNNCError, match="rows are not its samples' own"):
        Routes(g, split_graph(g, atomic, [list(range(c + 1)), list(range(c + 1, n))]))


@pytest.mark.parametrize(("name", "replicas"), [("mixtral", [2, 1, 1, 1, 1, 1, 1]),
                                               ("mixtral", [1, 1, 1, 1, 1, 1]),
                                               ("qwen2_moe", [2, 1, 1, 1, 1, 1, 1])])
def test_the_planner_never_cuts_a_mixed_value(name: str, replicas: list[int]) -> None:
    """Six or seven stages of a two-layer model, 64 blocks: without the rule these plans cut
    inside the experts (sort indices and sorted rows crossed); every stage input is now rows
    of its samples."""
    case, cap = _captured(name)
    g = cap.graph
    mixed = row_mixed(g)
    n = sum(replicas)
    plan = rannc.plan(case.model, (), case.batch(16),
                      cluster=rannc.Cluster.homogeneous(n=n, per_node=n),
                      config=rannc.Config(replicas=replicas, microbatches=2, blocks=64,
                                          profiler="estimate"))
    atomic = atomic_components(g)
    stages = split_graph(g, atomic, [list(st.components) for st in plan.stages])
    crossing = {v for st in stages for v in st.inputs} & mixed
    assert not crossing, crossing


@pytest.mark.parametrize(("name", "replicas"), [("mixtral", [1, 1, 1, 1, 1, 1]),
                                               ("qwen2_moe", [2, 1, 1])])
def test_the_eval_graph_placed_on_the_deployed_stages_never_cuts_a_mixed_value(
        name: str, replicas: list[int]) -> None:
    """`model.eval()` after a training deployment: the eval graph's components are placed on
    the trained plan's stages (rannc.derive). Each parameterless component used to follow its
    inputs to the earliest stage, so the experts' sort stayed before a cut its consumers were
    after (found with rannc.check on Qwen2-MoE, 4 ranks, replicas [2, 1, 1]: refused at
    deployment, naming to_19). Its producers now move to the consumers' stage. Checked with
    the plan's graph (each op starts on the stage the plan ran it on) and without it (a plan
    loaded from a file: every op from the earliest stage, where only that rule keeps the
    sort with its consumers)."""
    case, _ = _captured(name)
    n = sum(replicas)
    plan = rannc.plan(case.model, (), case.batch(16),
                      cluster=rannc.Cluster.homogeneous(n=n, per_node=n),
                      config=rannc.Config(replicas=replicas, microbatches=2, blocks=64,
                                          profiler="estimate"))
    case.model.eval()
    g = capture(case.model, (), case.batch(4)).graph
    atomic = atomic_components(g)
    holders = plan.holder_stages()
    for base in (plan, dataclasses.replace(plan, source=None)):
        derived = derive_plan(g, atomic, base, recompute=False)
        stages = split_graph(g, atomic, [list(st.components) for st in derived.stages])
        assert not {v for st in stages for v in st.inputs} & row_mixed(g)
        Routes(g, stages)  # deployable: no stage input it refuses
        # each parameter stays on a stage of the trained plan that holds it
        for st in derived.stages:
            assert all(st.index in holders[p] for p in st.param_names)


def test_an_attention_flattening_seq_and_batch_is_interleaved_and_never_cut() -> None:
    """torch's nn.MultiheadAttention flattens (seq, batch, embed) to (seq * batch, embed) for
    its output projection: those rows interleave the samples. Found so, and their view back
    to (seq, batch, embed) is not; Hugging Face's attention (batch-major throughout) has none.
    A plan of 4 stages over the torch encoder cuts none of them (before, a 3-rank plan cut
    one: semantics_check `interleaved`)."""
    from rannc.graph.row_mixing import interleaved, unsplittable

    case, cap = _captured("torch_attention")
    g = cap.graph
    found = interleaved(g)
    assert found and all(g.values[v].shape[0] == f"{zoo.SEQ}*batch" for v in found), found
    assert {g.values[v].shape for v in found} <= {(f"{zoo.SEQ}*batch", 32)}
    assert all("interleaved" in unsplittable(g)[v] for v in found)
    assert not interleaved(_captured("bert")[1].graph)
    case, cap = _captured("torch_encoder")
    g = cap.graph
    found = interleaved(g)
    assert found
    plan = rannc.plan(case.model, (), case.batch(16), cluster=rannc.Cluster.homogeneous(n=4, per_node=4),
                      config=rannc.Config(partition_num=4, microbatches=2, blocks=64,
                                          profiler="estimate"))
    stages = split_graph(g, atomic_components(g), [list(st.components) for st in plan.stages])
    assert not {v for st in stages for v in st.inputs} & found


def test_an_output_interleaving_its_samples_is_refused() -> None:
    """A sequence-first model returning (seq * batch, n) flattened rows: the pieces' rows
    joined sample after sample scrambled it (3 ranks, 2 microbatches: outputs off by 0.9);
    refused with the fix before planning."""
    from rannc.validate import check_outputs_combine

    class SeqFirstFlat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).transpose(0, 1).reshape(-1, 5)

    cap = capture(SeqFirstFlat(), (torch.randn(3, 6, 4),))
    with pytest.raises(rannc.CaptureError, match=r"interleaves the samples' rows.*transpose\(0, 1\)"):
        check_outputs_combine(cap, "SeqFirstFlat")
