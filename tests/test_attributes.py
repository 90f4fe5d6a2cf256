"""Python values the model's code reads in forward are guarded (rannc/graph/attributes.py): a
change after a capture captures the model again instead of running the old graph. One process;
the multi-rank case (transformers' BERT on 3 ranks) is test_semantics_mpi.py's "attributes",
ranks that differ in such a value are test_bad_input.py's "attribute_differs_across_ranks"."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import rannc
from examples.models.toy import DataDependent
from rannc.errors import CaptureError
from rannc.graph import attributes
from rannc.graph.capture import capture

pytestmark = pytest.mark.layer("single_process")
_MODULE_SETATTR = nn.Module.__setattr__  # (as torch defines it)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.scale = 2.0
        self.calls = 0  # written in forward: not a guard (torch.export puts it back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.act(self.lin(x)) * self.scale


def _pair() -> tuple[nn.Module, nn.Module, rannc.RaNNCModule]:
    torch.manual_seed(0)
    net = Scaled()
    ref = copy.deepcopy(net)
    return net, ref, rannc.RaNNCModule(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_a_changed_attribute_captures_again_and_a_restored_one_reuses_its_capture() -> None:
    net, ref, wrapped = _pair()
    x = torch.randn(3, 4)
    seen = []
    for scale in (2.0, 5.0, 2.0, 5.0, 0.5):
        net.scale = ref.scale = scale
        torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
        seen.append(len(wrapped._deployments))
    assert seen == [1, 2, 2, 2, 3], seen  # (2.0 and 5.0 again: their captures)


def test_a_swapped_module_captures_again() -> None:
    net, ref, wrapped = _pair()
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    net.act, ref.act = nn.Tanh(), nn.Tanh()  # (no parameters: nothing else notices)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2


def test_what_forward_writes_and_the_mode_are_not_guards() -> None:
    _net, _ref, wrapped = _pair()
    x = torch.randn(3, 4)
    for _ in range(3):
        wrapped(x)
    (dep,) = wrapped._deployments.values()
    labels = [r.label for r in dep.captured.reads.reads]
    assert "scale" in labels and "calls" not in labels and not any(
        "training" in lab for lab in labels), labels


def test_an_attribute_changed_at_every_step_is_warned_about_once() -> None:
    net, ref, wrapped = _pair()
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(6):
            net.scale = ref.scale = 1.0 + step
            torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    said = [str(w.message) for w in got if "has changed" in str(w.message)]
    assert len(said) == 1 and "attribute scale has changed 3 times" in said[0], said
    assert "register_buffer" in said[0]


def test_transformers_config_and_attention_attributes() -> None:
    """BERT: an attention's `scaling` and `config.output_hidden_states` changed after the first
    call; the outputs follow the unwrapped model's (before: the first capture's)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=3)
    model = BertForSequenceClassification(cfg).eval()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    ids = torch.randint(0, 64, (4, 8))
    torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits)
    for m in (model, ref):
        m.bert.encoder.layer[0].attention.self.scaling *= 3
    torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits)
    for m in (model, ref):
        m.config.output_hidden_states = True
    got, want = wrapped(input_ids=ids), ref(input_ids=ids)
    assert got.hidden_states is not None and len(got.hidden_states) == len(want.hidden_states)
    torch.testing.assert_close(got.hidden_states[-1], want.hidden_states[-1])
    assert len(wrapped._deployments) == 3


def test_reads_record_plain_instance_values_only() -> None:
    class Net(nn.Module):
        limit = 3  # a class attribute: not recorded

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.dims = (0, 1)
            self.table = {"k": 2.0}  # plain values in a dict: guarded by a copy
            self.blocks = [nn.Identity()]  # not plain: its contents are not followed
            self.dtype_ = torch.float32

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            return (self.lin(x) * self.table["k"] * self.limit).sum(self.dims).to(self.dtype_)

    net = Net()
    cap = capture(net, (torch.randn(3, 4),))
    got = {r.label: r.value for r in cap.reads.reads}
    assert got["dims"] == (0, 1) and got["dtype_"] is torch.float32
    assert got["table"] == {"k": 2.0} and got["table"] is not net.table
    assert "limit" not in got and "blocks" not in got and "training" not in got
    assert {k for k in got if k.startswith("lin.")} == set(), got  # nn.Linear reads tensors only
    assert "__getattribute__" not in nn.Module.__dict__


class Listed(nn.Module):
    """Reads a list and a dict of plain values, as PEFT's LoRA layers read their merged
    adapters and per-adapter scalings."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.merged: list[str] = []
        self.scaling = {"a": 0.5}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h if self.merged else h * (1 + self.scaling["a"])


def test_a_list_or_dict_changed_in_place_captures_again() -> None:
    torch.manual_seed(0)
    net = Listed()
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    x = torch.randn(3, 4)
    seen = []
    for change in (None, lambda m: m.scaling.update(a=2.0), lambda m: m.merged.append("a"),
                   lambda m: m.merged.clear(), lambda m: m.scaling.update(a=0.5)):
        if change is not None:
            change(net)
            change(ref)
        torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
        seen.append(len(wrapped._deployments))
    assert seen == [1, 2, 3, 3, 3], seen  # (the last two: earlier captures' values again)


def test_a_dict_built_in_another_order_reads_the_same_on_every_rank() -> None:
    """The digest the ranks compare shows a dict by key: equal dicts built in another order
    (from a set, under another PYTHONHASHSEED) are one value, not a refusal."""
    owner = nn.Linear(1, 1)
    a = attributes.Reads((attributes.Read(owner, "", "scaling", {"a": 0.5, "b": 2.0}),))
    b = attributes.Reads((attributes.Read(owner, "", "scaling", {"b": 2.0, "a": 0.5}),))
    c = attributes.Reads((attributes.Read(owner, "", "scaling", {"a": 0.5, "b": 3.0}),))
    assert a.digest == b.digest != c.digest


def test_peft_merge_and_scale_after_wrapping_are_exact() -> None:
    """PEFT LoRA adapters switched, disabled, merged and rescaled after the first call, as
    scripts do between training and evaluation: every output equals the unwrapped model's.
    Before, `merge_adapter()` (its layers' `merged_adapters` list) and `set_scale()` (their
    `scaling` dict) kept the capture's values: the merged weights plus the adapter again
    (off by 0.04), the old scale (off by 0.08)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False))

    def lora(alpha: int) -> object:
        return peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.0, init_lora_weights=False)

    model = peft.get_peft_model(base, lora(8), adapter_name="a")
    model.add_adapter("b", lora(16))
    model.set_adapter("a")
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    ids = torch.randint(0, 64, (3, 8))

    def rescale(m: nn.Module) -> None:
        for layer in m.modules():
            if hasattr(layer, "set_scale") and isinstance(getattr(layer, "scaling", None), dict):
                layer.set_scale("b", 3.0)

    for change in (lambda m: None, lambda m: m.set_adapter("b"),
                   lambda m: m.base_model.disable_adapter_layers(),
                   lambda m: m.base_model.enable_adapter_layers(), lambda m: m.merge_adapter(),
                   lambda m: m.unmerge_adapter(), rescale):
        change(model)
        change(ref)
        with torch.no_grad():
            torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-6)


def test_the_recorder_is_gone_after_a_failed_capture() -> None:
    with pytest.raises(CaptureError):  # (a branch on a value: not capturable)
        capture(DataDependent(4), (torch.randn(3, 4),))
    assert "__getattribute__" not in nn.Module.__dict__
    assert nn.Module.__setattr__ is _MODULE_SETATTR


def test_changed_names_the_values() -> None:
    net = Scaled()
    cap = capture(net, (torch.randn(3, 4),))
    assert cap.reads.hold()
    net.scale = 3.0
    assert not cap.reads.hold()
    assert attributes.describe(cap.reads.changed()) == "scale 2.0 -> 3.0"
    net.scale = 2  # an int equal to the float read: another value (another graph constant)
    assert not cap.reads.hold()
    del net.scale
    assert attributes.describe(cap.reads.changed()) == "scale 2.0 -> (deleted)"


class Masked(nn.Module):
    """A tensor held as a plain attribute (not a buffer), read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


def test_a_tensor_attribute_replaced_captures_again_and_one_changed_in_place_does_not() -> None:
    """torch.export makes such a tensor a constant of the graph (the tensor object itself): a
    change in place reaches the graph; a new tensor assigned did not (before: the old mask kept
    being applied)."""
    torch.manual_seed(0)
    net = Masked()
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    for m in (net, ref):
        m.mask.mul_(2)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 1
    for m in (net, ref):
        m.mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2
    changed = attributes.describe(capture(Masked(), (x,)).reads.changed())
    assert changed == "", changed
    cap = capture(net, (x,))
    net.mask = torch.zeros(2)
    assert attributes.describe(cap.reads.changed()) == (
        "mask a tensor of shape (4,) and torch.float32 -> another tensor")


def test_a_parameter_removed_after_the_first_call_captures_again() -> None:
    """torch's pruning replaces a parameter with a parameter, a buffer and a pre-hook: the model
    is captured again (before: KeyError 'lin.weight' at the next call)."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    net = Masked()
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    x = torch.randn(3, 4)
    wrapped(x)
    for m in (net, ref):
        torch.manual_seed(1)
        prune.random_unstructured(m.lin, "weight", amount=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the pre-hook: warned, computes the weight exactly)
        torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2


class GradModeBranch(nn.Module):
    """Computes otherwise under torch.no_grad() (as a model that skips work it only needs for
    training does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if torch.is_grad_enabled() else y * 3


def test_a_model_reading_the_grad_mode_gets_a_capture_per_grad_mode() -> None:
    """Before, a call under no_grad ran the graph captured with grad enabled (off by y)."""
    torch.manual_seed(0)
    net = GradModeBranch()
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2
    labels = [r.label for r in capture(net, (x,)).reads.reads]
    assert labels == ["torch.is_grad_enabled()"], labels
    # (a model that does not read it: one capture for both modes)
    wrapped = rannc.RaNNCModule(Scaled())
    wrapped(x)
    with torch.no_grad():
        wrapped(x)
    assert len(wrapped._deployments) == 1


def test_tensors_forward_stores_on_modules_are_assigned_after_every_call() -> None:
    """A layer storing its auxiliary loss and gate probabilities on itself (MoE style): the
    training loop's sum of the stored losses, its gradients and the stored probabilities equal
    the unwrapped model's at every step (before: the attributes kept their values from before
    the first call, a zero loss and None)."""
    from model_zoo import StoresAux

    torch.manual_seed(0)
    net = StoresAux()
    ref = copy.deepcopy(net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (net, ref)]
    wrapped = rannc.RaNNCModule(net, opts[0])
    for _step in range(3):
        x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
        losses = [nn.functional.cross_entropy(m(x), y) + 0.1 * s.aux()
                  for m, s in ((wrapped, net), (ref, ref))]
        torch.testing.assert_close(net.aux(), ref.aux(), rtol=1e-6, atol=1e-7)
        assert net.aux() != 0
        for a, b in zip(net.layers, ref.layers, strict=True):
            torch.testing.assert_close(a.probs, b.probs, rtol=1e-6, atol=1e-7)
        for loss in losses:
            loss.backward()
        for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len(wrapped._deployments) == 1


def test_a_number_forward_stores_is_warned_about() -> None:
    class Stat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.stat = 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.stat = y.mean().item()
            return y

    with pytest.warns(UserWarning, match=r"forward stores a number computed from a tensor's "
                                         r"values, or tensors inside a list or dict, in stat "
                                         r".*self.stat = loss.detach\(\)"):
        rannc.RaNNCModule(Stat())(torch.randn(3, 4))

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.cache = [y.detach()]
            return y

    with pytest.warns(UserWarning, match=r"tensors inside a list or dict, in cache"):
        rannc.RaNNCModule(Cached())(torch.randn(3, 4))


class Memory(nn.Module):
    """State carried from call to call in a plain tensor attribute (Transformer-XL's memory):
    forward reads it, then stores a new one."""

    def __init__(self, rows: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mems = torch.zeros(1, 4)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + self.mems.mean(0, keepdim=True)
        self.mems = h.detach() if self.rows else h.detach().mean(0, keepdim=True)
        return h


def test_state_carried_in_a_tensor_attribute_is_exact_or_warned() -> None:
    """Stored with the batch's rows, the next call reads the new tensor (a capture of its own:
    before, every call computed with the first memory, off by 0.8); stored without rows it
    cannot be returned from the graph, and that is said."""
    torch.manual_seed(0)
    net = Memory()
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the third capture's: keep it in a buffer)
        for _ in range(3):
            x = torch.randn(3, 4)
            torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    with pytest.warns(UserWarning, match=r"forward reads the tensor in mems and replaces it"):
        rannc.RaNNCModule(Memory(rows=False))(torch.randn(3, 4))
