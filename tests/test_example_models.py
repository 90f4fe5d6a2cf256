"""The example models: each toy model captures (DataDependent fails with a useful error), and
the tiny BiT ResNet trains forward/backward and updates its BatchNorm running statistics."""

from __future__ import annotations

import pytest
import torch

from examples.models.resnet import BiTResNet, bit_resnet
from examples.models.toy import DataDependent, ForkJoin, KwargsModel, SharedParam
from rannc.errors import CaptureError
from rannc.graph.capture import capture
from rannc.graph.task_graph import ValueKind

pytestmark = pytest.mark.layer("pure")

D = 16
B = 4


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_fork_join_captures() -> None:
    cap = capture(ForkJoin(D), (torch.randn(B, D),))
    g = cap.graph
    assert len(g.values_of_kind(ValueKind.PARAM)) == 6
    assert len(g.inputs) == 1
    out = g.values[g.outputs[0]]
    assert out.shape[1:] == (4,) and out.batch_dim == 0
    # The input feeds both branches and the skip connection.
    assert len(g.consumers(g.inputs[0])) >= 3


def test_shared_param_captures_once() -> None:
    model = SharedParam(D)
    cap = capture(model, (torch.randn(B, D),))
    g = cap.graph
    params = {g.values[v].target for v in g.values_of_kind(ValueKind.PARAM)}
    assert params == {"shared.weight", "shared.bias", "middle.weight", "middle.bias"}
    shared_w = next(v for v in g.values_of_kind(ValueKind.PARAM)
                    if g.values[v].target == "shared.weight")
    assert len(g.consumers(shared_w)) == 2  # used at two depths


def test_kwargs_model_captures_with_mask_and_scale() -> None:
    x, mask = torch.randn(B, D), torch.ones(B, D)
    cap = capture(KwargsModel(D), (x,), {"mask": mask, "scale": 2.0})
    g = cap.graph
    assert len(g.inputs) == 2  # x and mask; the float scale is a constant
    out, loss = (g.values[v] for v in g.outputs)  # dict outputs flatten by key: out, loss
    assert out.batch_dim == 0
    assert loss.shape == () and loss.batch_dim is None


def test_kwargs_model_captures_with_extra() -> None:
    cap = capture(KwargsModel(D), (torch.randn(B, D),),
                  {"mask": torch.ones(B, D), "extra": torch.randn(B, D)})
    assert len(cap.graph.inputs) == 3


def test_kwargs_model_captures_with_all_kwargs() -> None:
    # Sorted-key order (extra, mask, scale) differs from forward's order (mask, scale, extra).
    cap = capture(KwargsModel(D), (torch.randn(B, D),),
                  {"mask": torch.ones(B, D), "scale": 0.5, "extra": torch.randn(B, D)})
    assert len(cap.graph.inputs) == 3
    assert cap.graph.values[cap.graph.outputs[0]].batch_dim == 0


def test_kwargs_model_eager() -> None:
    model = KwargsModel(D)
    x, mask, extra = torch.randn(B, D), torch.zeros(B, D), torch.randn(B, D)
    res = model(x, mask=mask, scale=2.0, extra=extra)
    expected = (model.linear.bias + extra) * 2.0
    torch.testing.assert_close(res["out"], expected)
    assert res["loss"].dim() == 0


def test_data_dependent_raises_capture_error() -> None:
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(8), (torch.randn(B, 8),))
    assert info.value.module_path == "gate"
    assert "gate" in str(info.value)


def _tiny() -> BiTResNet:
    model = bit_resnet(blocks=(1, 1), base_channels=8, num_classes=10)
    assert isinstance(model, BiTResNet)
    return model


def test_tiny_bit_resnet_captures() -> None:
    cap = capture(_tiny(), (torch.randn(B, 3, 16, 16),))
    g = cap.graph
    assert g.values_of_kind(ValueKind.BUFFER)  # BatchNorm running statistics
    assert any(t.mutates for t in g.tasks)  # updated in place
    out = g.values[g.outputs[0]]
    assert out.shape[1:] == (10,) and out.batch_dim == 0


def test_tiny_bit_resnet_forward_backward_updates_batchnorm() -> None:
    model = _tiny().train()
    bn = model.body[0].units[0].norm1
    before = bn.running_mean.clone()
    x, y = torch.randn(B, 3, 16, 16), torch.randint(0, 10, (B,))
    logits = model(x)
    assert logits.shape == (B, 10)
    loss = torch.nn.functional.cross_entropy(logits, y)
    loss.backward()
    assert not torch.equal(bn.running_mean, before)
    assert int(bn.num_batches_tracked) == 1
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.root[0].weight.grad.abs().sum() > 0  # gradients reach the stem


def test_bit_resnet_sizes_and_validation() -> None:
    with torch.device("meta"):
        r50 = bit_resnet(50)
        r101x2 = bit_resnet(101, width=2, num_classes=10)
    n50 = sum(p.numel() for p in r50.parameters())
    assert 25_000_000 < n50 < 26_000_000  # ResNet-50 size
    assert r101x2.head.in_features == 2048 * 2
    assert len(r101x2.body[2].units) == 23
    with pytest.raises(ValueError, match="depth"):
        bit_resnet(34)
    with pytest.raises(ValueError, match="width"):
        bit_resnet(50, width=9)
