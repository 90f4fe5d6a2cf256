"""Capture (torch.export -> TaskGraph): value kinds, batch dims, input/output layouts, the meta
device, error reporting, and the graph fingerprint."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from model_zoo import Case, make_case
from torch import nn

from examples.models.toy import DataDependent
from rannc.errors import CaptureError
from rannc.graph.capture import CapturedModel, _sdpa_masks, capture, flatten_inputs
from rannc.graph.task_graph import TaskGraph, Value, ValueKind
from rannc.module import RaNNCModule

pytestmark = pytest.mark.layer("pure")


# -- helpers ------------------------------------------------------------------------------------
def output_value(graph: TaskGraph, i: int) -> Value:
    name = graph.outputs[i]
    assert name is not None, f"output {i} is not a value"
    return graph.values[name]


def reachable_from_inputs(graph: TaskGraph) -> list[bool]:
    """Per task: does it read a model input, directly or through other tasks' tensors? (What
    depends on the inputs' sizes alone, e.g. arange(batch), is constant.)"""
    live = set(graph.inputs)
    out = []
    for t in graph.tasks:
        hit = any(v in live for v in t.inputs)
        if hit:
            live.update(o for o in t.outputs if graph.values[o].is_tensor)
        out.append(hit)
    return out


def check_value_kinds(model: nn.Module, cap: CapturedModel) -> None:
    g = cap.graph
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, v in g.values.items():
        if v.producer is not None:
            continue
        if v.kind is ValueKind.PARAM:
            assert v.target in params, name
        elif v.kind is ValueKind.BUFFER:
            assert v.target in buffers, name
        elif v.kind is ValueKind.INPUT:
            assert name in g.inputs
        else:
            assert v.kind is ValueKind.CONSTANT, f"{name}: graph input of kind {v.kind}"
            assert name in cap.constants  # a tensor lifted from the model's code
    # Every parameter and buffer tensor of the model is a graph input (tied weights once).
    used_params = {id(params[v.target or ""]) for v in g.values.values() if v.kind is ValueKind.PARAM}
    assert used_params == {id(p) for p in model.parameters()}
    used_bufs = {id(buffers[v.target or ""]) for v in g.values.values() if v.kind is ValueKind.BUFFER}
    assert used_bufs == {id(b) for b in model.buffers()}
    # User tensors are INPUT values, named by their flat leaf position.
    assert g.inputs == g.values_of_kind(ValueKind.INPUT)
    for name in g.inputs:
        target = g.values[name].target or ""
        assert target.startswith("input[")
        assert cap.leaf_values[int(target[6:-1])] == name
    # Task outputs: ACTIVATION when reachable from an input through tensors, CONSTANT otherwise.
    reach = reachable_from_inputs(g)
    for t, task in enumerate(g.tasks):
        for o in task.outputs:
            assert g.values[o].producer == task.name
            want = ValueKind.ACTIVATION if reach[t] else ValueKind.CONSTANT
            assert g.values[o].kind is want, f"{o} ({task.op}) is {g.values[o].kind}, expected {want}"


def run_captured(cap: CapturedModel, model: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    """Run the exported graph on the model's own tensors and rebuild the output via out_spec."""
    leaves, _ = flatten_inputs(args, kwargs)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    user: Iterator[Any] = iter(leaves)
    ins: list[Any] = []
    n_user = 0
    for node in cap.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        v = cap.graph.values.get(node.name)
        if node.name in cap.constants:
            ins.append(cap.constants[node.name])
        elif v is not None and v.kind is ValueKind.PARAM:
            ins.append(params[v.target or ""])
        elif v is not None and v.kind is ValueKind.BUFFER:
            ins.append(buffers[v.target or ""])
        else:  # a user input, tensor or not, in flat leaf order
            ins.append(next(user))
            n_user += 1
    assert n_user == len(leaves) == len(cap.leaf_values)
    flat = list(cap.gm(*ins))
    assert len(flat) == len(cap.graph.outputs)
    return pytree.tree_unflatten(flat, cap.out_spec)


def assert_same_tree(a: Any, b: Any) -> None:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    assert type(a) is type(b)
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y)
        else:
            assert x == y


class ConvBN(nn.Module):
    """conv -> BatchNorm (training: in-place counter), scaled by a constant computed from a
    parameter, plus a registered buffer and a plain tensor attribute (a lifted constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.offset: torch.Tensor
        self.register_buffer("offset", torch.arange(4.0))
        self.const = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        scale = self.conv.weight.abs().mean()
        return h * scale + self.offset.view(1, 4, 1, 1) + self.const.view(1, 4, 1, 1)


@pytest.fixture(scope="module")
def bert() -> tuple[Any, CapturedModel]:
    case = make_case("bert")
    return case, capture(case.model, case.args, case.kwargs)


# -- value kinds --------------------------------------------------------------------------------
def test_value_kinds_conv_batchnorm() -> None:
    torch.manual_seed(0)
    model = ConvBN().train()
    x = torch.randn(2, 3, 5, 5)
    cap = capture(model, (x,))
    check_value_kinds(model, cap)
    g = cap.graph
    kinds = {n: v.kind for n, v in g.values.items()}
    targets = {v.target: v.kind for v in g.values.values() if v.producer is None}
    assert targets == {
        "conv.weight": ValueKind.PARAM, "conv.bias": ValueKind.PARAM,
        "bn.weight": ValueKind.PARAM, "bn.bias": ValueKind.PARAM,
        "offset": ValueKind.BUFFER, "bn.running_mean": ValueKind.BUFFER,
        "bn.running_var": ValueKind.BUFFER, "bn.num_batches_tracked": ValueKind.BUFFER,
        "const": ValueKind.CONSTANT, "input[0]": ValueKind.INPUT,
    }
    by_op: dict[str, list[ValueKind]] = {}
    for t in g.tasks:
        by_op.setdefault(t.op, []).extend(kinds[o] for o in t.outputs)
    assert by_op["aten.conv2d.default"] == [ValueKind.ACTIVATION]
    assert by_op["aten.batch_norm.default"] == [ValueKind.ACTIVATION]
    assert by_op["aten.add_.Tensor"] == [ValueKind.CONSTANT]  # num_batches_tracked += 1
    assert by_op["aten.abs.default"] == by_op["aten.mean.default"] == [ValueKind.CONSTANT]
    assert by_op["aten.view.default"] == [ValueKind.CONSTANT, ValueKind.CONSTANT]
    (inc,) = [t for t in g.tasks if t.mutates]
    assert inc.mutates == inc.inputs and g.values[inc.inputs[0]].target == "bn.num_batches_tracked"
    torch.testing.assert_close(run_captured(cap, model, (x,), {}), model(x))


def test_value_kinds_bert(bert: tuple[Any, CapturedModel]) -> None:
    case, cap = bert
    check_value_kinds(case.model, cap)
    g = cap.graph
    # Keyword inputs keep their names and come in sorted-key order.
    assert g.inputs == sorted(case.kwargs)
    assert len(g.values_of_kind(ValueKind.BUFFER)) == 2  # position_ids, token_type_ids
    # The decoder weight is tied to the word embeddings: torch.export lifts both names, as
    # two PARAM values naming the same tensor; only one of them is read.
    params = dict(case.model.named_parameters(remove_duplicate=False))
    tied = [n for n in g.values_of_kind(ValueKind.PARAM) if g.values[n].shape == (99, 32)]
    assert {g.values[n].target for n in tied} == {
        "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}
    assert len({id(params[g.values[n].target or ""]) for n in tied}) == 1
    assert sorted(len(g.consumers(n)) > 0 for n in tied) == [False, True]
    assert g.values_of_kind(ValueKind.CONSTANT)  # e.g. position-id slices computed from buffers


def _tiny_bert_without_mask() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(0, 64, (3, 16))  # keys a multiple of 16: the fused kernels need no padding
    return model, {"input_ids": ids, "labels": ids}


def _attention_masks(cap: CapturedModel) -> list[torch.Tensor]:
    return [mask.meta["val"] for _, mask in _sdpa_masks(cap.gm)]


class KeyBroadcastMask(nn.Module):
    """Attention under a mask computed from the input and expanded across the keys (stride 0
    in its last dimension): one value of the mask per query."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, -1))
        rows = x[:, :, 0] > -100.0  # every query, but from the data: not known at capture
        mask = rows[:, None, :, None].expand(b, 1, s, s)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return a.square().sum()


def test_attention_masks_are_dense_along_the_keys() -> None:
    """Off the CPU, every fused attention kernel refuses a mask strided 0 along the keys (a GPU
    then ran the math attention: BERT at 1.49x plain PyTorch's memory). The captured graph
    hands the kernels one contiguous copy, with the same values: results unchanged, and a mask
    computed from the input is kept even where it is all True."""
    torch.manual_seed(0)
    model = KeyBroadcastMask()
    x = torch.randn(3, 16, 8)
    cap = capture(model, (x,), {})
    masks = _attention_masks(cap)
    assert len(masks) == 1 and masks[0].stride()[-1] == 1
    assert [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    ref = copy.deepcopy(model)
    out, expected = run_captured(cap, model, (x,), {}), ref(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.backward()
    expected.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_an_all_true_mask_made_from_literals_is_dropped_as_eager_does() -> None:
    """BERT called without an attention mask: traced, Hugging Face builds `arange(S) >= 0`
    expanded over the batch and the keys, where eager passes no mask. The capture evaluates it,
    finds every key taking part and passes no mask either (a mask costs the GPU's kernels an
    additive bias per layer); losses and gradients as eager's."""
    model, kw = _tiny_bert_without_mask()
    cap = capture(model, (), kw)
    sdpa = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and not _attention_masks(cap)
    assert not [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.arange.default]  # dead, erased
    ref = copy.deepcopy(model)
    out = run_captured(cap, model, (), kw)
    expected = ref(**kw)
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=0)
    out.loss.backward()
    expected.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_causal_mask_made_from_shapes_becomes_is_causal_as_eager_does(name: str) -> None:
    """GPT-2 and Llama called without an attention mask: traced, transformers builds the causal
    mask from position ids expanded over the symbolic batch, where eager passes `is_causal`.
    The capture evaluates the mask for batches of 1 and 2, finds the lower triangle, and makes
    eager's call (a mask costs the kernels an additive bias per layer, and FlashAttention takes
    none); the loss bit-exact against eager, at the capture's batch size and another, and the
    gradients so on GPT-2 (Llama's differ from eager's in the last bits with a mask too: its
    backward sums a tensor's gradients in another order)."""
    case = make_case(name, batch=3)
    cap = capture(case.model, case.args, case.kwargs)
    sdpa = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and not _attention_masks(cap)
    assert all(n.kwargs.get("is_causal") is True for n in sdpa), [n.kwargs for n in sdpa]
    for rows in (3, 5):
        model = copy.deepcopy(case.model)
        ref = copy.deepcopy(case.model)
        kw = {k: torch.randint(0, 97, (rows, 10)) for k in ("input_ids",)}
        kw["labels"] = kw["input_ids"]
        out, expected = run_captured(cap, model, (), kw), ref(**kw)
        torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=0)
        out.loss.backward()
        expected.loss.backward()
        exact = {"rtol": 0, "atol": 0} if name == "gpt2" else {}
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **exact, msg=n)


def test_masks_from_the_data_or_not_causal_stay() -> None:
    """A padding mask the caller passes, and a literal mask that is not the lower triangle (a
    sliding window), reach the attention as given."""
    case = make_case("llama", batch=3)
    kw = {**case.kwargs, "attention_mask": torch.ones_like(case.kwargs["input_ids"])}
    kw["attention_mask"][0, :2] = 0
    assert len(_attention_masks(capture(case.model, case.args, kw))) == 2

    class Window(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            i = torch.arange(x.shape[1])
            band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
            return F.scaled_dot_product_attention(x, x, x, attn_mask=band)

    x = torch.randn(2, 16, 8)
    cap = capture(Window(), (x,), {})
    assert len(_attention_masks(cap)) == 1
    torch.testing.assert_close(run_captured(cap, Window(), (x,), {}), Window()(x), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_bert_runs_the_fused_attention_on_a_gpu() -> None:
    """With only the memory-efficient kernel allowed, a mask strided 0 along the keys raises
    'No available kernel'; the captured graph runs forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = KeyBroadcastMask().cuda()
    x = torch.randn(3, 16, 8, device="cuda")
    cap = capture(model, (x,), {})
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = run_captured(cap, model, (x,), {})
        out.backward()
    assert torch.isfinite(out)


# -- batch dims ---------------------------------------------------------------------------------
def test_batch_dims_bert(bert: tuple[Any, CapturedModel]) -> None:
    _, cap = bert
    g = cap.graph
    seq, vocab = 12, 99
    ids = g.values["input_ids"]
    assert ids.batch_dim == 0 and ids.batch_scale == 1
    assert ids.shape == ("batch", seq)
    logits_2d = [v for v in g.values.values() if v.shape == (f"{seq}*batch", vocab)]
    assert len(logits_2d) == 1  # prediction_scores.view(-1, vocab) for the MLM loss
    assert logits_2d[0].batch_dim == 0 and logits_2d[0].batch_scale == seq
    assert logits_2d[0].numel(batch=3) == 3 * seq * vocab
    loss = output_value(g, 0)
    assert loss.shape == () and loss.batch_dim is None
    for name in g.values_of_kind(ValueKind.PARAM):
        v = g.values[name]
        assert v.batch_dim is None and all(isinstance(d, int) for d in v.shape), name
    mlm = output_value(g, 1)
    assert mlm.shape == ("batch", seq, vocab) and mlm.batch_dim == 0


def test_batch_of_one_still_has_a_symbolic_batch() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(1, 4)
    cap = capture(model, (x,))
    g = cap.graph
    (inp,) = g.inputs
    assert g.values[inp].shape == ("batch", 4) and g.values[inp].batch_dim == 0
    out = output_value(g, 0)
    assert out.shape == ("batch", 2) and out.batch_dim == 0
    assert cap.layout.batch_leaves == (True,)
    torch.testing.assert_close(run_captured(cap, model, (x,), {}), model(x))

    case = make_case("fork_join", batch=1)
    g = capture(case.model, case.args, case.kwargs).graph
    assert g.values[g.inputs[0]].shape == ("batch", 16)


class _WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + table.sum(0)


def test_batch_of_one_does_not_batch_other_inputs() -> None:
    cap = capture(_WithTable(), (torch.randn(1, 4), torch.randn(2, 4)))
    assert cap.layout.batch_leaves == (True, False)  # holds
    table = cap.graph.values[cap.graph.inputs[1]]
    assert table.shape == (2, 4) and table.batch_dim is None  # fails: ("batch", 4), 0


# -- inputs and outputs -------------------------------------------------------------------------
def test_positional_keyword_float_and_none_inputs() -> None:
    case = make_case("kwargs")  # x positional; mask tensor, scale=0.5, extra=None by keyword
    cap = capture(case.model, case.args, case.kwargs)
    g = cap.graph
    # Flat leaves: (x,), then kwargs sorted by key: extra (None), mask, scale (a float).
    assert cap.layout.batch_leaves == (True, False, True, False)
    x_name, extra, mask_name, scale = cap.leaf_values
    assert extra is None and scale is None  # not values: a None and a Python float
    assert g.inputs == [x_name, mask_name]
    assert [g.values[v].target for v in g.inputs] == ["input[0]", "input[2]"]
    for v in g.inputs:
        assert g.values[v].shape == ("batch", 16) and g.values[v].batch_dim == 0
    # The dict output round-trips through out_spec; the float 0.5 is baked into the graph.
    res = run_captured(cap, case.model, case.args, case.kwargs)
    assert isinstance(res, dict) and list(res) == ["out", "loss"]
    assert_same_tree(res, case.model(*case.args, **case.kwargs))
    assert cap.output_constants == [None, None]


class VarKeywords(nn.Module):
    """A forward taking its mask and a scale through **kwargs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        y = self.lin(x) * kwargs.get("scale", 1.0)
        if "mask" in kwargs:
            y = y.masked_fill(kwargs["mask"] == 0, 0.0)
        return y


def test_keywords_caught_by_var_kwargs_are_batched_inputs() -> None:
    # torch.export 2.13 cannot match dynamic shapes to a **kwargs argument: the capture failed
    # with "Must provide a tree_name when there might be a mismatch".
    torch.manual_seed(0)
    model = VarKeywords()
    x, mask = torch.randn(5, 6), (torch.rand(5, 6) > 0.3).long()
    cap = capture(model, (x,), {"mask": mask, "scale": 0.5})
    assert cap.layout.batch_leaves == (True, True, False)
    for v in cap.graph.inputs:
        assert cap.graph.values[v].shape == ("batch", 6)
    assert "forward" not in model.__dict__  # the signature shown to torch.export is undone
    for n in (5, 3):  # another batch size runs on the same capture
        args, kwargs = (x[:n],), {"mask": mask[:n], "scale": 0.5}
        assert_same_tree(run_captured(cap, model, args, kwargs), model(*args, **kwargs))


def test_model_output_round_trips(bert: tuple[Any, CapturedModel]) -> None:
    from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

    case, cap = bert
    eager = case.model(*case.args, **case.kwargs)
    assert isinstance(eager, BertForPreTrainingOutput)
    assert pytree.tree_flatten(eager)[1] == cap.out_spec
    res = run_captured(cap, case.model, case.args, case.kwargs)
    assert type(res) is BertForPreTrainingOutput
    assert list(res.keys()) == ["loss", "prediction_logits", "seq_relationship_logits"]
    assert_same_tree(res, eager)


# -- meta device ----------------------------------------------------------------------------------
def test_meta_model_captures_without_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import BertConfig, BertForPreTraining

    def no_cuda(*_: object, **__: object) -> None:
        raise AssertionError("capture initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with torch.device("meta"):
        cfg = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024)
        model = BertForPreTraining(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), device="meta")
    mask = torch.ones(2, 16, dtype=torch.long, device="meta")
    cap = capture(model, (), {"input_ids": ids, "attention_mask": mask})
    g = cap.graph
    assert not torch.cuda.is_initialized()
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert all(t.is_meta for t in cap.constants.values())
    assert all(t.is_meta for t in cap.gm.state_dict().values())
    n_layers = len({t.module_path.split(".")[3] for t in g.tasks
                    if t.module_path.startswith("bert.encoder.layer.")})
    assert n_layers == 4
    emb = [v for v in g.values.values() if v.kind is ValueKind.PARAM and v.shape == (cfg.vocab_size, 256)]
    assert len(emb) == 2  # word embeddings and the decoder tied to them (one tensor, two names)
    assert g.values["input_ids"].shape == ("batch", 16)


# -- errors ---------------------------------------------------------------------------------------
class _FixesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(4, -1)  # the batch size is hard-coded


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), _FixesBatch())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.pre(x))


def test_fixed_batch_size_raises_capture_error() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_Outer(), (torch.randn(4, 4),))
    assert info.value.__cause__ is not None
    assert "fixes the batch size" in str(info.value)  # the hint among the usual causes


def test_fixed_batch_size_error_names_the_module() -> None:
    """torch.export reports the batch pinned to a constant only after tracing, with no stack:
    capture exports again watching the guards and names the module whose code pinned it."""
    with pytest.raises(CaptureError) as info:
        capture(_Outer(), (torch.randn(4, 4),))
    assert info.value.module_path == "body.1"
    assert "'body.1'" in str(info.value) and "_FixesBatch.forward" in str(info.value)
    assert "`return self.linear(x).view(4, -1)  # the batch size is hard-coded`" in str(info.value)
    # the shape environment's logger is as it was (nothing printed, nothing left attached)
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    assert not any(type(h).__name__ == "Watch" for h in log.handlers)


def _pairs_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, torch.arange(len(logits)))  # CLIP's contrastive loss


class _Pairs(nn.Module):
    """A linear layer, and a loss over its rows' pairs computed by a function it calls."""

    def __init__(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return self.loss(y @ y.t())


@pytest.mark.layer("single_process")
def test_fixed_batch_size_in_a_function_the_model_calls_quotes_its_line() -> None:
    """The line that pins the batch may be in a function forward calls (transformers' CLIP
    computes its loss so): the error quotes that line, not only the module's call of it."""
    with pytest.raises(CaptureError) as info:
        capture(_Pairs(_pairs_loss), (torch.randn(4, 4),))
    line = _pairs_loss.__code__.co_firstlineno + 1
    assert "_Pairs.forward (" in str(info.value)
    assert (f"the line {__file__}:{line}: `return F.cross_entropy(logits, "
            "torch.arange(len(logits)))  # CLIP's contrastive loss`") in str(info.value)
    assert "installed package" not in str(info.value)


@pytest.mark.layer("single_process")
def test_fixed_batch_size_in_an_installed_package_says_it_is_not_the_users_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the pinning line is a library's (transformers' CLIP loss, Llava's `list(features)`),
    "derive it from the input" is no fix the user can make: the error says whose code it is."""
    package = tmp_path / "site-packages" / "somelib"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import torch\n\n"
        "def pairs_loss(logits):\n"
        "    return torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    somelib = importlib.import_module("somelib")
    with pytest.raises(CaptureError, match=r"somelib/__init__.py:4: `return torch.nn.functional"
                                           r".*That code is in an installed package \(somelib\), "
                                           r"not in yours"):
        capture(_Pairs(somelib.pairs_loss), (torch.randn(4, 4),))


def test_fixed_batch_size_in_a_hugging_face_style_buffer_names_the_module() -> None:
    """A constant-sized tensor made in forward and combined with the batch (a common way to
    pin it) is found the same way."""

    class Pads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.zeros(6, x.shape[1])

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Pads()))
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(6, 4),))
    assert info.value.module_path == "1.1", str(info.value)


def test_data_dependent_control_flow_names_the_child_module() -> None:
    model = nn.Sequential(nn.Linear(8, 8), DataDependent(8))
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(4, 8),))
    err = info.value
    assert err.module_path == "1.gate"
    assert "'1.gate'" in str(err) and "_Gate.forward" in str(err)
    assert err.__cause__ is not None


def test_gpt2_with_cache_asks_for_use_cache_false() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    assert cfg.use_cache  # the default
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (2, 10))
    assert model(input_ids=ids).past_key_values is not None  # eager returns a cache object
    with pytest.raises(CaptureError) as info:
        capture(model, (), {"input_ids": ids})
    msg = str(info.value)
    assert "use_cache=False" in msg
    assert "Cache" in msg  # torch.export's reason: a DynamicCache in the output
    assert info.value.__cause__ is not None


# -- fingerprint ----------------------------------------------------------------------------------
def test_fingerprint_stable_and_sensitive_to_sizes() -> None:
    def mlp(hidden: int, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    fp = capture(mlp(8, 0), (torch.randn(3, 4),)).graph.fingerprint()
    assert len(fp) == 16
    assert capture(mlp(8, 0), (torch.randn(3, 4),)).graph.fingerprint() == fp
    assert capture(mlp(8, 1), (torch.randn(3, 4),)).graph.fingerprint() == fp  # weights don't count
    assert capture(mlp(8, 0), (torch.randn(5, 4),)).graph.fingerprint() == fp  # the batch is symbolic
    assert capture(mlp(9, 0), (torch.randn(3, 4),)).graph.fingerprint() != fp
    assert capture(mlp(8, 0), (torch.randn(3, 4, 4),)).graph.fingerprint() != fp

    a, b = make_case("fork_join"), make_case("fork_join", seed=1)
    assert capture(a.model, a.args).graph.fingerprint() == capture(b.model, b.args).graph.fingerprint()


def test_fixed_batch_size_error_explains_the_fix() -> None:
    with pytest.raises(CaptureError, match=r"fixes the batch size .*x\.size\(0\) or -1") as info:
        capture(_Outer(), (torch.randn(4, 4),))
    assert info.value.__cause__ is not None


class _MeanByLen(nn.Module):
    """A loss divided by the batch size, the way user code often writes it."""

    def __init__(self, count: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).sum() / self.count(x)


@pytest.mark.layer("single_process")
def test_batch_size_made_a_python_number_names_len_and_the_fix() -> None:
    """`/ len(x)` and `/ float(x.size(0))` fix the batch size to the call's (torch.export
    turns the Python number into a guard): the error names them and the symbolic form, which
    captures and computes the same loss."""
    for count in (len, lambda x: float(x.size(0))):
        with pytest.raises(CaptureError, match=r"makes a Python number of it \(len\(x\), "
                                               r"float\(x.size\(0\)\).*`loss.sum\(\) / "
                                               r"x.size\(0\)`, not `/ len\(x\)`"):
            capture(_MeanByLen(count), (torch.randn(4, 4),))
    with pytest.raises(CaptureError, match=r"Python SymFloat computed inside forward.*"
                                           r"`t / x.size\(0\)`, not `t \* \(1.0 / x.size\(0\)\)`"):
        capture(_MeanByLen(lambda x: x.size(0) * 1.0), (torch.randn(4, 4),))
    model = _MeanByLen(lambda x: x.size(0))
    x = torch.randn(5, 4)
    torch.testing.assert_close(RaNNCModule(copy.deepcopy(model))(x), model(x), rtol=0, atol=0)


@pytest.mark.layer("single_process")
def test_a_torchscript_submodule_is_named_with_the_fix() -> None:
    """torch.export cannot trace a ScriptModule (it failed with "Sub.forward() takes 2
    positional arguments but 3 were given"; before that, reading the model's module tree
    raised AttributeError: 'OrderedModuleDict' object has no attribute 'get')."""
    net = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU())))
    with pytest.raises(CaptureError, match=r"module\(s\) '1' \(Sequential\) are TorchScript "
                                           r"modules .*Fix: use the Python module"):
        RaNNCModule(net)(torch.randn(3, 4))


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _RegisteredBatch:
    x: torch.Tensor
    y: torch.Tensor


torch.export.register_dataclass(_RegisteredBatch)


class _TakesABatchObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, b: Any) -> torch.Tensor:
        return nn.functional.mse_loss(self.lin(b.x), b.y)


@pytest.mark.layer("single_process")
def test_a_batch_object_is_named_unless_registered_and_then_captured() -> None:
    """A dataclass batch torch's pytree does not open was a constant to rannc: "a batch of 0
    rows". Named with the fix; registered (torch.export.register_dataclass), it is captured
    and exact (before, its dynamic shapes failed: "Node type mismatch; expected list")."""
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    with pytest.raises(CaptureError, match=r"argument 'args\[0\]' is a dataclass \(_Batch\) "
                                           r"holding tensors.*register_dataclass\(_Batch\)"):
        RaNNCModule(_TakesABatchObject())(_Batch(x, y))
    model = _TakesABatchObject()
    got = RaNNCModule(copy.deepcopy(model))(_RegisteredBatch(x, y))
    torch.testing.assert_close(got, model(_RegisteredBatch(x, y)), rtol=0, atol=0)


# -- writes (mutations) ---------------------------------------------------------------------------
def _single_process_equal(case: Case, steps: int = 2) -> None:
    """RaNNCModule in one process equals the unwrapped model: outputs, gradients, buffers."""
    ref, wrapped = copy.deepcopy(case.model), RaNNCModule(copy.deepcopy(case.model))
    for _ in range(steps):
        out, want = wrapped(*case.args, **case.kwargs), ref(*case.args, **case.kwargs)
        assert_same_tree(out, want)
        case.loss(out).backward()
        case.loss(want).backward()
    for (n, p), (_, q) in zip(wrapped.module.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=f"grad of {n}")
    for (n, b), (_, c) in zip(wrapped.module.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, msg=f"buffer {n}")


@pytest.mark.layer("single_process")
def test_every_write_into_a_tensor_made_in_forward_is_kept() -> None:
    """Slice copies, tensor/boolean index_put, scatter, fills, writes through transpose and view
    aliases, and buffer updates (through a view, input-dependent) all reach the result. Before
    functionalisation the slice copy_ had no reader and was erased (T5/BART/Whisper/Swin)."""
    _single_process_equal(make_case("writes", batch=6))


@pytest.mark.layer("single_process")
def test_t5_given_only_labels_shifts_them_right() -> None:
    """T5 builds decoder_input_ids with shift_tokens_right (a write into new_zeros)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ids, labels = torch.randint(1, 64, (3, 7)), torch.randint(1, 64, (3, 5))
    _single_process_equal(Case("t5", model, (), dict(input_ids=ids, labels=labels),
                               lambda out: out.loss), steps=1)


class _WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = 0.0
        return self.lin(x)


class _WritesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


@pytest.mark.parametrize("model, what", [(_WritesInput, "input"), (_WritesParameter, "parameter")])
def test_a_write_rannc_cannot_keep_is_a_capture_error_naming_the_line(model: type, what: str) -> None:
    with pytest.raises(CaptureError, match=rf"writes into its {what} .*test_capture.py:\d+") as e:
        capture(model(), (torch.randn(3, 4),))
    assert "clone" in str(e.value)


def test_a_meta_model_drops_the_same_all_true_masks() -> None:
    """The masks are evaluated on the CPU, so a meta-device capture (rannc.plan's, which
    cannot compute a value) drops them as a real capture does."""
    with torch.device("meta"):
        model, _ = _tiny_bert_without_mask()
    _, kw = _tiny_bert_without_mask()
    cap = capture(model, (), kw)
    sdpa = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and not _attention_masks(cap)


def test_capturing_on_meta_under_autocast_says_the_graph_is_not_autocast() -> None:
    """Autocast does not act on meta tensors: a meta model captured under autocast traces in
    float32 (its products are not bfloat16), so planning it under autocast estimates another
    run; a warning says so and what to do. On a real device, or without autocast, nothing."""
    import warnings

    for dev, casting, warns in (("meta", True, True), ("cpu", True, False), ("meta", False, False)):
        with torch.device(dev):
            m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
            x = torch.randn(4, 8)
        with warnings.catch_warnings(record=True) as got, \
                torch.autocast("cpu", torch.bfloat16, enabled=casting):
            warnings.simplefilter("always")
            cap = capture(m, (x,), {})
        said = [w for w in got if "meta device under torch.autocast" in str(w.message)]
        assert len(said) == (1 if warns else 0), (dev, casting, [str(w.message) for w in got])
        linear = [t for t in cap.graph.tasks if t.op == "aten.linear.default"][0]
        half = dev == "cpu" and casting
        assert cap.graph.values[linear.outputs[0]].dtype == ("bfloat16" if half else "float32")
        if warns:
            assert "model.to(torch.bfloat16)" in str(said[0].message)


_LAYERDROP_SOURCE = '''
import torch
from torch import nn


class Encoder(nn.Module):
    """Hugging Face's LayerDrop as transformers 4.x and 5.x before 5.2x write it: one draw per
    layer in training, compared with the probability even when it is 0."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(0.5)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    to_drop = True
            if not to_drop:
                x = torch.tanh(layer(x))
        return self.drop(x)
'''


@pytest.fixture
def hf_layerdrop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A module defined in a file under a `transformers` folder (what the capture looks for)."""
    import importlib.util

    folder = tmp_path / "transformers"
    folder.mkdir()
    (folder / "layerdrop_model.py").write_text(_LAYERDROP_SOURCE)
    spec = importlib.util.spec_from_file_location("layerdrop_model", folder / "layerdrop_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.layer("single_process")
def test_layerdrop_of_zero_captures_and_runs_as_eager(hf_layerdrop: Any) -> None:
    """BART, Whisper, OPT, Wav2Vec2 and 50 more under transformers before 5.2x: `if
    torch.rand([]) < self.layerdrop` made torch.export fail (a branch on a tensor's value)."""
    torch.manual_seed(0)
    model = hf_layerdrop.Encoder(0.0).train()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    cap = capture(model, (x,))
    # the draws stay (one a layer, as eager makes them: the random stream stays aligned)
    assert sum(t.op.startswith("aten.rand") for t in cap.graph.tasks) == 3
    wrapped = RaNNCModule(model)
    wrapped(x)  # (captures)
    torch.manual_seed(1)
    out = wrapped(x)
    torch.manual_seed(1)
    want = ref(x)
    torch.testing.assert_close(out, want)  # the same dropout mask: drawn after the same draws
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_layerdrop_that_skips_layers_at_random_is_refused_by_name(hf_layerdrop: Any) -> None:
    model = hf_layerdrop.Encoder(0.1).train()
    with pytest.raises(CaptureError, match=r"LayerDrop, probability 0\.1.*encoder_layerdrop"):
        capture(model, (torch.randn(6, 8),))
    # p = 1 drops every layer in every step: one graph, captured as eager runs it
    model = hf_layerdrop.Encoder(1.0).train()
    cap = capture(model, (torch.randn(6, 8),))
    assert not any("addmm" in t.op or "linear" in t.op for t in cap.graph.tasks)


def test_a_random_draw_outside_transformers_is_torchs_own() -> None:
    """The capture changes torch.rand([]) only for Hugging Face's code: elsewhere a draw used
    as a value stays in the graph."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * torch.rand([])

    cap = capture(Noisy(), (torch.randn(3, 4),))
    assert any("rand" in t.op for t in cap.graph.tasks)
    assert torch.rand([]).shape == ()  # (restored after the capture)


def test_a_number_taken_from_a_tensor_is_refused_naming_its_module_and_line() -> None:
    """(Funnel under transformers 5.17 sizes its relative positions this way: the error said
    only "value item has unsupported type SymFloat".)"""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * x.abs().max().item()

    with pytest.raises(CaptureError, match=r"item is a Python SymFloat computed inside forward.*"
                                           r"in module '.*' \(.*test_capture.py:\d+: return "
                                           r"self.inner\(x\) \* x.abs\(\).max\(\).item\(\)\)"):
        capture(Scaled(), (torch.randn(3, 4),))


@pytest.mark.layer("single_process")
def test_a_mask_built_with_vmap_captures_and_runs_as_eager() -> None:
    """Hugging Face's masks before transformers 5 are built with torch.vmap (Llama, Mistral,
    Qwen2, GPT-2 under 4.57): the graph held functorch's nesting calls, which take and give no
    tensor, and running it failed ("your tensor may have escaped from inside a function being
    vmapped")."""

    class VmapMasked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            s = x.shape[1]
            pos = torch.arange(s)
            # per batch row and query: which keys it sees (causal, and the row's padding)
            mask = torch.vmap(lambda row: torch.vmap(lambda q: (pos <= q) & row)(pos))(keep)
            h = self.lin(x)
            scores = (h @ h.transpose(1, 2)).masked_fill(~mask, -1e4)
            return scores.softmax(-1) @ h

    torch.manual_seed(0)
    model = VmapMasked()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, 8)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[1, 4:] = False
    cap = capture(model, (x, keep))
    assert not any("vmap" in t.op or "batch_dim" in t.op for t in cap.graph.tasks)
    out = RaNNCModule(model)(x, keep)
    want = ref(x, keep)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model.lin.weight.grad, ref.lin.weight.grad)


class _RouterCast(nn.Module):
    """A router that casts its classifier in forward, as NLLB-MoE's and Switch Transformers'
    do (`self.classifier = self.classifier.to(self.dtype)`): nothing to convert."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(4, 3)
        self.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).softmax(-1)


@pytest.mark.layer("single_process")
def test_a_conversion_in_forward_that_changes_nothing_captures() -> None:
    """Before: "_apply(): Couldn't swap Linear.weight" (torch.export traces it on fake
    parameters). A conversion that would change a tensor is still torch's to refuse."""
    torch.manual_seed(0)
    model = _RouterCast()
    x = torch.randn(5, 4)
    torch.testing.assert_close(RaNNCModule(copy.deepcopy(model))(x), model(x), rtol=0, atol=0)
    model.dtype = torch.float64
    with pytest.raises(CaptureError, match="classifier"):
        capture(model, (x,))


def test_buffers_written_under_no_grad_in_forward_are_known_as_written() -> None:
    """torch.export records a `with torch.no_grad():` block as one region op over a submodule;
    the buffers written inside are the op's `mutates` (the runtime puts them back before a
    call is run again, and keeps their readers in their stage)."""
    from model_zoo import NoGradWrites

    cap = capture(NoGradWrites(), (torch.randn(4, 8),))
    written = {cap.graph.values[v].target for t in cap.graph.tasks for v in t.mutates}
    assert written == {"calls", "ema"}, written


class _GathersFeatures(nn.Module):
    """A contrastive head as DDP scripts write it: every rank's features gathered in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.lin(x)
        parts = [torch.zeros_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, y)
        return torch.cat(parts).pow(2).mean()


@pytest.mark.layer("single_process")
def test_a_collective_in_forward_is_refused_naming_the_line(tmp_path: Any) -> None:
    """On several ranks it ran on one stage's ranks only: a gloo time-out after a minute."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(CaptureError, match=r"collective \(all_gather_into_tensor\) in forward, "
                           r"in module '\(the model itself\)' at .*dist.all_gather\(parts, y\)"):
            capture(_GathersFeatures(), (torch.randn(3, 4),))
    finally:
        dist.destroy_process_group()


class _ReadsData(nn.Module):
    """`.data` read in forward, as older code does: a weight used without its gradient, an
    input detached."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x.data)
        return nn.functional.linear(h, self.b.weight.data) + h


class _MomentumEncoder(nn.Module):
    """MoCo's key encoder, updated in forward by assigning `.data`."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters(), strict=True):
                pk.data = pk.data * 0.9 + pq.data * 0.1
        return self.q(x) + self.k(x)


@pytest.mark.layer("single_process")
def test_data_read_in_forward_captures_as_detach() -> None:
    """Before: "We found a fake tensor in the exported program constant's list" (torch.export
    cannot trace `.data`), naming no line. Now it reads as `.detach()`: outputs and gradients
    as eager's (b.weight gets none through `.data`)."""
    torch.manual_seed(0)
    model = _ReadsData()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    wrapped = RaNNCModule(model)
    out, want = wrapped(x), ref(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=0, atol=0)
    assert model.b.weight.grad is None and ref.b.weight.grad is None
    assert torch.Tensor.data is torch._C.TensorBase.data  # (put back after the capture)


def test_an_assignment_to_data_in_forward_is_refused_naming_the_line() -> None:
    with pytest.raises(CaptureError, match=r"assignment to a tensor's .data .*test_capture.py:\d+"
                       r".*after optimizer.step\(\)"):
        capture(_MomentumEncoder(), (torch.randn(3, 4),))
    assert torch.Tensor.data is torch._C.TensorBase.data
    x = torch.randn(2, 3)
    x.data = torch.ones(2, 3)  # (torch's own again)
    assert bool((x == 1).all())


def test_an_embedding_with_max_norm_is_refused_naming_the_option() -> None:
    """nn.Embedding(max_norm=...) renormalises its weight in place in forward: refused as any
    write into a parameter, saying which option does it and what to do instead."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    with pytest.raises(CaptureError, match=r"parameter '0.weight' .*max_norm=None") as e:
        capture(model, (torch.randint(0, 10, (3, 5)),))
    assert "embedding_renorm_" in str(e.value)


class _SquareBias(nn.Module):
    """Attention with an additive (seq, seq) bias passed beside the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v


def test_an_input_batched_by_chance_is_named() -> None:
    """A (seq, seq) bias with seq equal to the batch size is taken for a batched input; the
    batch-size error also names it and the fix (before: only "the model's code fixes the batch
    size", which it does not). With another batch size it captures."""
    model = _SquareBias()
    with pytest.raises(CaptureError, match=r"Or: input\(s\) bias have the batch size .*mask\[None\]"):
        capture(model, (torch.randn(5, 5, 4),), {"bias": torch.zeros(5, 5)})
    capture(model, (torch.randn(3, 5, 4),), {"bias": torch.zeros(5, 5)})


class _Recurrent(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 4, batch_first=batch_first)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_a_sequence_first_recurrent_layer_is_named() -> None:
    """nn.LSTM is sequence-first by default: given (seq, batch, features), rannc takes the
    time steps for the rows, and torch.export pins their number. The error names the layer and
    batch_first=True (before: only "the model's code fixes the batch size")."""
    with pytest.raises(CaptureError, match=r"LSTM 'rnn' is sequence-first \(batch_first=False\).*"
                                           r"Fix: build it with batch_first=True"):
        capture(_Recurrent(batch_first=False), (torch.randn(5, 3, 6),))
    with warnings.catch_warnings():  # (LSTM lists its own weights again in forward: no warning)
        warnings.simplefilter("error", UserWarning)
        capture(_Recurrent(batch_first=True), (torch.randn(3, 5, 6),))


class _PackedLSTM(nn.Module):
    """An LSTM over packed sequences (older NLP code), or over the padded batch taking each
    row's output at its last step: the rewrite the refusal names."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.embed = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence

        if self.packed:
            seq = pack_padded_sequence(self.embed(x), lengths, batch_first=True, enforce_sorted=False)
            _out, (h, _c) = self.rnn(seq)
            return self.out(h[-1])
        out, _state = self.rnn(self.embed(x))
        return self.out(out[torch.arange(out.size(0)), lengths - 1])


def test_a_packed_sequence_is_refused_naming_the_line_and_the_rewrite() -> None:
    """Before: torch.export failed inside the LSTM ("zeros(): argument 'size' failed to unpack
    the object ... FakeTensor"), naming only the LSTM. The rewrite it names gives the packed
    model's outputs and captures."""
    from torch.nn.utils.rnn import PackedSequence

    real = PackedSequence.__dict__["__new__"]
    x, lengths = torch.randint(0, 20, (4, 6)), torch.tensor([6, 3, 5, 2])
    with pytest.raises(CaptureError, match=r"PackedSequence .*_PackedLSTM.forward \(.*test_capture.py:\d+\)"
                       r".*lengths - 1") as info:
        capture(_PackedLSTM(packed=True), (x, lengths))
    assert info.value.module_path == "<root>"
    assert PackedSequence.__dict__["__new__"] is real  # (put back after the capture)
    torch.manual_seed(0)
    packed = _PackedLSTM(packed=True)
    padded = copy.deepcopy(packed)
    padded.packed = False
    cap = capture(padded, (x, lengths))
    assert cap.graph.summary()
    torch.testing.assert_close(padded(x, lengths), packed(x, lengths), rtol=1e-6, atol=1e-6)


class _OwnGenerator(nn.Module):
    """Noise drawn from a generator the model keeps (sized by the input, or fixed)."""

    def __init__(self, sized: bool) -> None:
        super().__init__()
        self.sized = sized
        self.lin = nn.Linear(4, 4)
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape if self.sized else (4,)
        return self.lin(x + torch.randn(shape, generator=self.noise))


@pytest.mark.parametrize("sized", [True, False])
def test_a_generator_of_the_models_own_is_named_with_the_fix(sized: bool) -> None:
    """Before: "SymIntArrayRef expected to contain only concrete integers" (noise sized by the
    input) or "unsupported graph input kind CUSTOM_OBJ (lifted_custom_0)" (a fixed size)."""
    with pytest.raises(CaptureError, match=r"torch.Generator .*default generator.*as an input"):
        capture(_OwnGenerator(sized), (torch.randn(3, 4),))


class _Branch(nn.Module):
    """Computes other values from 8 rows on: a branch on the batch size (diffusers' upsampling
    has one at 64 rows, `contiguous()` first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if x.shape[0] >= 8:
            y = y * 2
        return y


@pytest.mark.layer("single_process")
def test_a_branch_on_the_batch_size_captures_the_batchs_branch_and_its_range() -> None:
    """torch.export refused such a model ("Constraints violated (batch)"): the graph is now the
    branch of the batch's size, for the range of sizes that take it, and names the line; for a
    pipeline's pieces (small_pieces), the branch below where the batch is above it."""
    line = f"_Branch.forward ({__file__}:"
    small = capture(_Branch(), (torch.randn(4, 4),))
    assert small.batch_rows == (1, 7) and line in small.rows_site \
        and small.rows_site.endswith("`if x.shape[0] >= 8:`"), small.rows_site
    assert small.fits(7) and not small.fits(8)
    big = capture(_Branch(), (torch.randn(10, 4),))
    assert big.batch_rows[0] == 8 and big.fits(8) and not big.fits(7), big.batch_rows
    pieces = capture(_Branch(), (torch.randn(10, 4),), small_pieces=True)
    assert pieces.batch_rows == (1, 7)
    assert len(big.graph.tasks) == len(pieces.graph.tasks) + 1  # (the product by 2)
    assert capture(nn.Linear(4, 4), (torch.randn(4, 4),)).batch_rows == (1, None)


@pytest.mark.layer("single_process")
def test_one_process_runs_each_batch_size_through_its_branch(caplog: pytest.LogCaptureFixture) -> None:
    """In one process the graph of a call is its batch's branch: batches on both sides of the
    model's branch are exactly the unwrapped model's, each branch captured once and kept."""
    torch.manual_seed(0)
    model = _Branch()
    ref = copy.deepcopy(model)
    wrapped = RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level(logging.INFO, logger="rannc"):
        for n in (4, 10, 3, 12):
            x = torch.randn(n, 4)
            torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    assert len(wrapped._deployments) == 2
    assert caplog.text.count("captured again") == 1
    assert "a batch of 10 rows, for which the model's code takes another branch than for the " \
           "1 to 7 rows captured" in caplog.text
