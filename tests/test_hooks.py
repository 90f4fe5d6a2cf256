"""Hooks a capture cannot keep are said at capture (rannc.graph.hooks): before, a tensor hook
registered in forward and a module's backward hooks silently never ran (gradients off), and a
forward hook's side effects ran once, on a fake tensor."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import rannc
from rannc.errors import CaptureError

pytestmark = pytest.mark.layer("single_process")


class Net(nn.Module):
    def __init__(self, rescale: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)
        self.rescale = rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.rescale and h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.b(h).sum()


def test_a_gradient_hook_registered_in_forward_is_refused_at_its_line() -> None:
    with pytest.raises(CaptureError, match=r"gradient hook is registered inside forward "
                                           r"\(Net.forward at .*test_hooks.py:\d+\)"):
        rannc.RaNNCModule(Net(rescale=True))(torch.randn(4, 3))


@pytest.mark.parametrize("register", [
    lambda m, seen: m.a.register_full_backward_hook(lambda mod, gi, go: seen.append(1)),
    lambda m, seen: m.register_full_backward_pre_hook(lambda mod, go: seen.append(1)),
], ids=["full_backward_hook", "full_backward_pre_hook"])
def test_backward_hooks_are_refused_naming_the_modules(register: Any) -> None:
    model = Net()
    register(model, [])
    with pytest.raises(CaptureError, match=r"backward hooks on '(a|\(the model itself\))' would "
                                           r"never run.*Fix: remove them"):
        rannc.RaNNCModule(model)(torch.randn(4, 3))


def test_a_global_backward_hook_is_refused() -> None:
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(CaptureError, match=r"every module \(a global hook"):
            rannc.RaNNCModule(Net())(torch.randn(4, 3))
    finally:
        handle.remove()


def test_forward_hooks_are_warned_once_and_what_they_compute_stays_exact() -> None:
    """A pre-hook that doubles the input is part of the graph (exact); the warning names the
    module, once for the model's captures."""
    model = Net()
    model.a.register_forward_pre_hook(lambda mod, inputs: (inputs[0] * 2,))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"forward hooks or pre-hooks on 'a' ran once, while "
                                         r"capturing"):
        out = wrapped(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    out.backward()
    ref(x).backward()
    assert model.a.weight.grad is not None and ref.a.weight.grad is not None
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=0, atol=0)


def _pair(model: nn.Module) -> tuple[nn.Module, rannc.RaNNCModule]:
    ref = copy.deepcopy(model)
    return ref, rannc.RaNNCModule(model)


def test_a_forward_hook_added_after_the_first_call_captures_again() -> None:
    """A hook that rescales a module's output, registered after the model was captured (as a
    user does for a probe or an ablation): before, the first capture kept running (outputs off
    by the rescaling). Removed again, the first capture is used again."""
    torch.manual_seed(0)
    model = Net()
    ref, wrapped = _pair(model)
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    handles = [m.a.register_forward_hook(lambda mod, i, o: o * 3) for m in (model, ref)]
    with pytest.warns(UserWarning, match="forward hooks or pre-hooks on 'a'"):
        got = wrapped(x)
    torch.testing.assert_close(got, ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2
    for h in handles:
        h.remove()
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2  # (the first capture again)


def test_a_hook_removed_after_the_first_call_is_no_longer_applied() -> None:
    torch.manual_seed(0)
    model = Net()
    handle = model.a.register_forward_pre_hook(lambda mod, inputs: (inputs[0] * 2,))
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="forward hooks"):
        wrapped(x)
    handle.remove()
    torch.testing.assert_close(wrapped(x), model(x), rtol=0, atol=0)


def test_a_backward_hook_added_after_the_first_call_is_refused() -> None:
    """Refused at capture, so also when added later (before: it silently never ran)."""
    wrapped = rannc.RaNNCModule(Net())
    x = torch.randn(4, 3)
    wrapped(x).backward()
    wrapped.module.b.register_full_backward_hook(lambda mod, gi, go: None)
    with pytest.raises(CaptureError, match=r"backward hooks on 'b' would never run"):
        wrapped(x)


def test_hooks_a_model_registers_in_its_first_forward_do_not_capture_it_again() -> None:
    """transformers' output recorders register forward hooks on the layers during the first
    forward that asks for hidden states: the capture is keyed by the hooks it left, so the next
    call reuses it."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 output_hidden_states=True))
    ref, wrapped = _pair(model)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        got, want = wrapped(input_ids=ids), ref(input_ids=ids)
        torch.testing.assert_close(got.hidden_states[-1], want.hidden_states[-1])
    assert len(wrapped._deployments) == 1


def test_a_reentrant_checkpoint_in_forward_is_refused_with_the_fix() -> None:
    """torch.export traces through its autograd Function's forward without gradients: the
    captured graph computed none (here, for the whole model: the output did not require grad).
    The non-reentrant form stays exact."""
    import torch.utils.checkpoint as cp

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 1)
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = cp.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
            return self.b(h).sum()

    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(CaptureError, match=r"use_reentrant=True\) in forward.*Fix: "
                                           r"use_reentrant=False"):
        rannc.RaNNCModule(Checkpointed(True))(x)
    torch.manual_seed(0)
    model = Checkpointed(False)
    ref = copy.deepcopy(model)
    rannc.RaNNCModule(model)(x).backward()
    ref(x).backward()
    assert model.a.weight.grad is not None and ref.a.weight.grad is not None
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=0, atol=0)


def _train_then_eval(wrapped: nn.Module, batch: dict[str, Any]) -> tuple[Any, list[str]]:
    """A training call, then an evaluation call under no_grad (a second capture): the first
    call's outputs, and the warnings both gave."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = wrapped(**batch)
        wrapped.eval()
        with torch.no_grad():
            wrapped(**batch)
    return out, [str(w.message) for w in got]


def test_hugging_face_gradient_checkpointing_is_exact_without_a_hook_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """`gradient_checkpointing_enable()` registers transformers' make_inputs_require_grads
    forward hook on the embeddings (it computes nothing): every capture warned of it before.
    The checkpointing itself is rannc's (said once at INFO); the model stays exact."""
    from conformance import zoo

    case = zoo.llama()
    case.model.gradient_checkpointing_enable()
    ref, wrapped = _pair(case.model)
    batch = case.batch(4)
    with caplog.at_level(logging.INFO, "rannc"):
        out, said = _train_then_eval(wrapped, batch)
    assert not [m for m in said if "hooks or pre-hooks" in m], said
    assert caplog.text.count("gradient checkpointing (gradient_checkpointing_enable) is replaced "
                             "by rannc's recomputation") == 1, caplog.text
    want = ref(**batch)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    for n, p in wrapped.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=0, atol=0, msg=n)


def test_hugging_face_output_capturing_hooks_are_exact_without_a_hook_warning() -> None:
    """transformers installs its output-capturing forward hooks on a model's layers the first
    time a call asks for hidden states (Segformer's segmentation head asks in every call); each
    later capture warned of them, though what they collect is returned by forward, so it is in
    the graph. Exact, hidden states too, with no hook warning."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    cfg = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                          hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                          num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
                          num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0, drop_path_rate=0.0)
    ref, wrapped = _pair(SegformerForSemanticSegmentation(cfg))
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 3, (2, 32, 32)),
             "output_hidden_states": True}
    out, said = _train_then_eval(wrapped, batch)
    assert not [m for m in said if "hooks or pre-hooks" in m], said
    assert any(m._forward_hooks for m in wrapped.module.modules())  # (transformers' own, installed)
    want = ref(**batch)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
    for h, w in zip(out.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(h, w, rtol=0, atol=0)
