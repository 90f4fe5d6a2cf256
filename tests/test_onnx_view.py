"""The ONNX view of a captured model with its atomic components, as Netron would read it."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from model_zoo import make_case

from rannc.atomic.components import atomic_components, task_attributes
from rannc.graph.capture import capture
from rannc.graph.onnx_export import export_onnx

pytestmark = pytest.mark.layer("pure")


def test_bert_exports_with_atomic_components(tmp_path: Path) -> None:
    case = make_case("bert")
    # Without token_type_ids BERT slices its position-id buffer for two components: a clone.
    kwargs = {k: v for k, v in case.kwargs.items() if k != "token_type_ids"}
    cap = capture(case.model, case.args, kwargs)
    atomic = atomic_components(cap.graph)
    path = tmp_path / "bert.onnx"
    export_onnx(cap.graph, path, task_attrs=task_attributes(cap.graph, atomic),
                initializers=case.model.state_dict())
    m = onnx.load(str(path))
    onnx.checker.check_model(m)
    comp = {n.name: next(a.i for a in n.attribute if a.name == "atomic_component")
            for n in m.graph.node}
    for c in atomic.components:
        assert comp[cap.graph.tasks[c.task].name] == c.index
    cloned = [n for n in m.graph.node if any(a.name == "cloned_into" for a in n.attribute)]
    assert {n.name for n in cloned} == {cap.graph.tasks[t].name for t in atomic.cloned_tasks}
    assert cloned
    assert len(m.graph.initializer) > 0
