"""ONNX export of captured task graphs (rannc.graph.onnx_export)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")

from rannc.graph.capture import capture  # noqa: E402
from rannc.graph.onnx_export import ATEN_DOMAIN, export_onnx, op_type, to_onnx_model  # noqa: E402
from rannc.graph.task_graph import TaskGraph, ValueKind  # noqa: E402

pytestmark = pytest.mark.layer("pure")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def _export_and_load(graph: TaskGraph, path: Path, **kw: Any) -> Any:
    export_onnx(graph, path, **kw)
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    return model


def _node(model: Any, name: str) -> Any:
    return next(n for n in model.graph.node if n.name == name)


def _attrs(node: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _dims(info: Any) -> list[int | str]:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value
            for d in info.type.tensor_type.shape.dim]


def _all_infos(model: Any) -> dict[str, Any]:
    g = model.graph
    return {i.name: i for i in [*g.input, *g.output, *g.value_info]}


def _check_structure(model: Any, graph: TaskGraph) -> None:
    """Nodes mirror tasks; every value is declared once, with its type and shape."""
    assert len(model.graph.node) == len(graph.tasks)
    for node, task in zip(model.graph.node, graph.tasks, strict=True):
        assert node.name == task.name
        assert node.domain == ATEN_DOMAIN
        assert node.op_type == op_type(task.op)
        assert list(node.input) == list(task.inputs)
        assert list(node.output) == list(task.outputs)
        attrs = _attrs(node)
        assert attrs["op"].decode() == task.op
        assert attrs["module_path"].decode() == task.module_path
        assert node.doc_string == task.module_path
    infos = _all_infos(model)
    g = model.graph
    assert len(infos) == len(g.input) + len(g.output) + len(g.value_info)  # names unique
    assert set(infos) == set(graph.values)
    for name, v in graph.values.items():
        tt = infos[name].type.tensor_type
        if v.dtype == "sym_int":
            assert tt.elem_type == onnx.TensorProto.INT64
            assert _dims(infos[name]) == []
        else:
            assert tt.elem_type == onnx.helper.np_dtype_to_tensor_dtype(
                torch.empty(0, dtype=getattr(torch, v.dtype)).numpy().dtype)
            assert _dims(infos[name]) == list(v.shape)
    expected_inputs = list(graph.inputs) + [
        n for n, v in graph.values.items()
        if v.producer is None and v.kind is not ValueKind.INPUT
    ]
    assert [i.name for i in g.input] == expected_inputs
    assert [o.name for o in g.output] == [o for o in graph.outputs if o is not None]
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[""] == 17 and ATEN_DOMAIN in opsets


def test_op_type() -> None:
    assert op_type("aten.linear.default") == "linear"
    assert op_type("aten.add.Tensor") == "add"
    assert op_type("aten.__and__.Tensor") == "__and__"


def test_mlp(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _mlp()
    cm = capture(model, (torch.randn(4, 8),))
    graph = cm.graph
    first, last = graph.tasks[0].name, graph.tasks[-1].name
    attrs = {first: {"atomic_component": 0, "stage": "s0"}, last: {"atomic_component": 2}}
    m = _export_and_load(graph, tmp_path / "mlp.onnx", task_attrs=attrs,
                         initializers=dict(model.named_parameters()))
    _check_structure(m, graph)

    a = _attrs(_node(m, first))
    assert a["atomic_component"] == 0 and a["stage"] == b"s0"
    assert _attrs(_node(m, last))["atomic_component"] == 2
    assert "atomic_component" not in _attrs(m.graph.node[1])

    x = next(i for i in m.graph.input if i.name == graph.inputs[0])
    assert _dims(x) == ["batch", 8]
    out = m.graph.output[0]
    assert _dims(out) == ["batch", 4]

    # Parameters embedded, keyed by target in the mapping, named by value in the file.
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    params = graph.values_of_kind(ValueKind.PARAM)
    assert set(inits) == set(params)
    for name in params:
        target = graph.values[name].target
        assert target is not None
        expected = model.get_parameter(target).detach().numpy()
        assert (inits[name] == expected).all()
    props = {p.key: p.value for p in m.metadata_props}
    assert props["rannc.fingerprint"] == graph.fingerprint()


def test_missing_parameter_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    cm = capture(model, (torch.randn(4, 8),))
    params = {"0.weight": model.get_parameter("0.weight")}
    with caplog.at_level("WARNING", logger="rannc.graph.onnx_export"):
        m = to_onnx_model(cm.graph, initializers=params)
    assert [t.name for t in m.graph.initializer] == ["p_0_weight"]
    assert "0.bias" in caplog.text and "2.weight" in caplog.text


def test_mlp_on_meta_has_no_initializers(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = _mlp()
        x = torch.randn(4, 8)
    cm = capture(model, (x,))
    assert len(cm.graph.tasks) == 3
    m = _export_and_load(cm.graph, tmp_path / "meta.onnx",
                         initializers=dict(model.named_parameters()))
    _check_structure(m, cm.graph)
    assert len(m.graph.initializer) == 0
    w = next(i for i in m.graph.input if i.name == "p_0_weight")
    assert _dims(w) == [16, 8]


def test_conv_batchnorm(tmp_path: Path) -> None:
    model = _conv_bn()
    cm = capture(model, (torch.randn(4, 3, 8, 8),))
    graph = cm.graph
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    bn = next(t.name for t in graph.tasks if t.op == "aten.batch_norm.default")
    m = _export_and_load(graph, tmp_path / "convbn.onnx", task_attrs={bn: {"block": 1}},
                         initializers=state)
    _check_structure(m, graph)
    assert _attrs(_node(m, bn))["block"] == 1
    # Parameters and buffers (running statistics, num_batches_tracked) embedded.
    inits = {t.name: t for t in m.graph.initializer}
    assert set(inits) == set(graph.values_of_kind(ValueKind.PARAM)) | set(
        graph.values_of_kind(ValueKind.BUFFER))
    assert inits["b_1_num_batches_tracked"].data_type == onnx.TensorProto.INT64
    # The in-place counter update is recorded.
    mut = [n for n in m.graph.node if "mutates" in _attrs(n)]
    assert [_attrs(n)["mutates"] for n in mut] == [[b"b_1_num_batches_tracked"]]
    assert _dims(m.graph.input[0]) == ["batch", 3, 8, 8]


def test_bert_for_pretraining(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(cfg)
    b, s = 4, 16
    kwargs = dict(
        input_ids=torch.randint(0, 100, (b, s)),
        attention_mask=torch.ones(b, s, dtype=torch.int64),
        labels=torch.randint(0, 100, (b, s)),
        next_sentence_label=torch.randint(0, 2, (b,)),
    )
    cm = capture(model, (), kwargs)
    graph = cm.graph
    attrs = {t.name: {"atomic_component": i % 3} for i, t in enumerate(graph.tasks)}
    m = _export_and_load(graph, tmp_path / "bert.onnx", task_attrs=attrs,
                         initializers={**model.state_dict(), **cm.constants})
    _check_structure(m, graph)
    for i, node in enumerate(m.graph.node):
        assert _attrs(node)["atomic_component"] == i % 3

    ids = next(i for i in m.graph.input if i.name == "input_ids")
    assert _dims(ids) == ["batch", 16]
    infos = _all_infos(m)
    dim_params = {d for info in infos.values() for d in _dims(info) if isinstance(d, str)}
    assert "batch" in dim_params
    assert "16*batch" in dim_params  # the (B*S, vocab) view of the MLM logits
    assert any(v.dtype == "sym_int" for v in graph.values.values())
    # A layer's module path reaches the node (and its doc_string, shown by Netron).
    paths = {n.doc_string for n in m.graph.node}
    assert "bert.encoder.layer.1.output.dense" in paths
    # Tied weights (the word embedding is read under the decoder's name): state_dict has
    # every alias, so every parameter the graph reads is embedded.
    assert {t.name for t in m.graph.initializer} >= set(graph.values_of_kind(ValueKind.PARAM))


class _ReturnsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, x, y


def test_output_that_is_an_input_or_repeated(tmp_path: Path) -> None:
    cm = capture(_ReturnsInput(), (torch.randn(4, 4),))
    graph = cm.graph
    outs = [o for o in graph.outputs if o is not None]
    # (the input returned as it is is a copy the graph computes: `_inputs_returned_as_copies`)
    made = [graph.tasks[graph.task_index(p)] for p in {graph.values[o].producer for o in outs} if p]
    copies = [t for t in made if t.op == "aten.clone.default"]
    assert [t.inputs for t in copies] == [(graph.inputs[0],)], made
    m = _export_and_load(graph, tmp_path / "ret.onnx")
    extra = [n for n in m.graph.node if n.op_type == "Identity"]
    assert len(m.graph.node) == len(graph.tasks) + len(extra)
    assert len(m.graph.output) == len(outs)
    names = [o.name for o in m.graph.output]
    assert len(set(names)) == len(names)
    produced = {o for n in m.graph.node for o in n.output}
    assert set(names) <= produced
    for ident in extra:
        (src,) = ident.input
        assert src in outs


def test_bfloat16_initializers_keep_their_type(tmp_path: Path) -> None:
    model = _mlp().to(torch.bfloat16)
    cm = capture(model, (torch.randn(4, 8, dtype=torch.bfloat16),))
    m = _export_and_load(cm.graph, tmp_path / "bf16.onnx",
                         initializers=dict(model.named_parameters()))
    w = next(t for t in m.graph.initializer if t.name == "p_0_weight")
    assert w.data_type == onnx.TensorProto.BFLOAT16
    got = torch.frombuffer(bytearray(w.raw_data), dtype=torch.bfloat16).reshape(16, 8)
    assert torch.equal(got, model.get_parameter("0.weight").detach())


def test_large_initializers_go_to_external_data(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from rannc.graph import onnx_export

    monkeypatch.setattr(onnx_export, "_EXTERNAL_DATA_BYTES", 0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))  # >1 KiB tensors
    cm = capture(model, (torch.randn(4, 8),))
    path = tmp_path / "ext.onnx"
    m = _export_and_load(cm.graph, path, initializers=model.state_dict())
    assert (tmp_path / "ext.onnx.data").exists()
    w = next(t for t in m.graph.initializer if t.name == "p_0_weight")
    assert (onnx.numpy_helper.to_array(w) == model.get_parameter("0.weight").detach().numpy()).all()


def test_bad_task_attrs() -> None:
    cm = capture(_mlp(), (torch.randn(4, 8),))
    name = cm.graph.tasks[0].name
    with pytest.raises(ValueError, match="not in the graph"):
        to_onnx_model(cm.graph, task_attrs={"no_such_task": {"stage": 0}})
    with pytest.raises(ValueError, match="reserved"):
        to_onnx_model(cm.graph, task_attrs={name: {"op": "x"}})
    with pytest.raises(TypeError, match="int or str"):
        to_onnx_model(cm.graph, task_attrs={name: {"stage": 1.5}})  # type: ignore[dict-item]


def test_missing_onnx_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    cm = capture(_mlp(), (torch.randn(4, 8),))
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match="pip install onnx"):
        to_onnx_model(cm.graph)


def test_stages_are_functions_netron_opens(tmp_path: Path) -> None:
    """group_by="stage": one local function per stage, called once from the main graph (Netron
    draws a call as one node that opens into the stage's graph); each task node keeps its
    stage as an attribute, in metadata_props, and as the name scope stage<k>/."""
    from rannc.graph.onnx_export import GROUP_DOMAIN

    cm = capture(_mlp(), (torch.randn(4, 8),))
    graph = cm.graph
    n = len(graph.tasks)
    stage_of = {t.name: 0 if i < n // 2 else 1 for i, t in enumerate(graph.tasks)}
    m = _export_and_load(graph, tmp_path / "staged.onnx",
                         task_attrs={t: {"stage": s} for t, s in stage_of.items()}, group_by="stage")
    calls = list(m.graph.node)
    assert [(c.op_type, c.domain, c.name) for c in calls] == [
        ("stage0", GROUP_DOMAIN, "stage0"), ("stage1", GROUP_DOMAIN, "stage1")]
    assert [{p.key: p.value for p in c.metadata_props} for c in calls] == [{"stage": "0"},
                                                                          {"stage": "1"}]
    fns = {(f.domain, f.name): f for f in m.functions}
    assert set(fns) == {(GROUP_DOMAIN, "stage0"), (GROUP_DOMAIN, "stage1")}
    seen = []
    for k, call in enumerate(calls):
        fn = fns[(GROUP_DOMAIN, f"stage{k}")]
        assert list(fn.input) == list(call.input) and list(fn.output) == list(call.output)
        for node in fn.node:
            task = node.name.removeprefix(f"stage{k}/")
            assert node.name == f"stage{k}/{task}" and stage_of[task] == k
            assert _attrs(node)["stage"] == k
            assert {p.key: p.value for p in node.metadata_props} == {"stage": str(k)}
            seen.append(task)
    assert seen == [t.name for t in graph.tasks]  # every task once, in order
    # stage 1 reads what stage 0 makes; the model's output leaves stage 1
    assert set(calls[0].output) & set(calls[1].input)
    assert m.graph.output[0].name in calls[1].output


def test_group_by_needs_a_group_for_every_task() -> None:
    cm = capture(_mlp(), (torch.randn(4, 8),))
    tasks = [t.name for t in cm.graph.tasks]
    with pytest.raises(ValueError, match="give every task a stage"):
        to_onnx_model(cm.graph, task_attrs={tasks[0]: {"stage": 0}}, group_by="stage")
    # stage 0 both before and after stage 1: the calls would read each other
    cyc = {t: {"stage": 1 if i == len(tasks) // 2 else 0} for i, t in enumerate(tasks)}
    with pytest.raises(ValueError, match="cycle"):
        to_onnx_model(cm.graph, task_attrs=cyc, group_by="stage")
