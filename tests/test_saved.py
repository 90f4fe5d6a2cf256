"""The estimate's kept bytes (`rannc.profile.saved`) against what autograd really saves on this
CPU: every storage `saved_tensors_hooks` sees while the captured graph runs forward, parameters
and model inputs left out (the memory model holds those as parameters and stage inputs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rannc.atomic.components import atomic_components
from rannc.graph.capture import CapturedModel, capture, flatten_inputs
from rannc.graph.task_graph import TaskGraph
from rannc.profile.device import Cluster, DeviceSpec
from rannc.profile.estimate import GraphCosts, runs_fused_kernels
from rannc.profile.saved import autocast_copies, bases, requires_grad, saved

pytestmark = pytest.mark.layer("pure")

B, S, H = 4, 16, 32


class TanhGelu(nn.Module):
    """GPT-2's gelu: eight elementwise ops, of which autograd keeps four tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, 4 * H)
        self.proj = nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.proj(h).sum()


class Block(nn.Module):
    """A BERT-like layer: attention (with dropout), residuals, layer norms, dropout, gelu."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, H)
        self.ln1 = nn.LayerNorm(H)
        self.ln2 = nn.LayerNorm(H)
        self.fc = nn.Linear(H, 4 * H)
        self.proj = nn.Linear(4 * H, H)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(H, dim=-1)
        q, k, v = (t.view(x.shape[0], S, 2, H // 2).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        a = a.transpose(1, 2).contiguous().view(x.shape[0], S, H)
        x = self.ln1(x + self.drop(self.out(a)))
        x = self.ln2(x + self.drop(self.proj(F.gelu(self.fc(x)))))
        return x.to(torch.float32)  # a no-op conversion: the same tensor


class Head(nn.Module):
    """A vocabulary projection and cross-entropy: the loss keeps its log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, H)
        self.block = Block()
        self.lm = nn.Linear(H, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(self.block(self.emb(ids)))
        return F.cross_entropy(logits.view(-1, 100), ids.view(-1))


def captured(model: nn.Module, args: tuple[Any, ...]) -> tuple[CapturedModel, list[Any]]:
    """`model(*args)` captured, and the values its graph module's placeholders take."""
    cap = capture(model, args, {})
    leaves, _ = flatten_inputs(args, {})
    env = cap.bind(model, leaves)
    return cap, [env.get(n.name) for n in cap.gm.graph.nodes if n.op == "placeholder"]


def _saved_storages(model: nn.Module, args: tuple[Any, ...]) -> tuple[TaskGraph, float, float]:
    """`model(*args)` captured and run forward once, under the caller's autocast: (graph,
    bytes autograd saves other than the weights' casts, bytes of those casts) (distinct
    storages, parameters and inputs left out)."""
    from rannc.profile.measure import _cast_of

    cap, ph = captured(model, args)
    params = {id(p) for p in model.parameters()}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {a.untyped_storage().data_ptr() for a in args}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = (st.nbytes(), _cast_of(t, params))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cap.gm(*ph)
    return (cap.graph, float(sum(b for b, cast in seen.values() if not cast)),
            float(sum(b for b, cast in seen.values() if cast)))


def autograd_saves(model: nn.Module, args: tuple[Any, ...]) -> tuple[TaskGraph, float]:
    """The captured graph and the bytes autograd saves running it forward once (distinct
    storages, parameters and inputs left out; the weights' autocast casts included)."""
    graph, acts, casts = _saved_storages(model, args)
    return graph, acts + casts


def autograd_saves_under_autocast(model: nn.Module, args: tuple[Any, ...]) -> tuple[TaskGraph, float, float]:
    """The graph captured under CPU bfloat16 autocast and what autograd saves running it
    forward once under it: (graph, bytes of the activations, bytes of the weights' casts)."""
    with torch.autocast("cpu", torch.bfloat16):
        return _saved_storages(model, args)


def kept_bytes(graph: TaskGraph, batch: int, fused: bool = False) -> float:
    kept, _ = saved(graph, fused=fused)
    return float((kept[:, 0] + kept[:, 1] * batch).sum())


@pytest.mark.parametrize("make,args", [
    (TanhGelu, lambda: (torch.randn(B, S, H),)),
    (Block, lambda: (torch.randn(B, S, H),)),
    (Head, lambda: (torch.randint(0, 100, (B, S)),)),
], ids=["tanh_gelu", "block", "head"])
def test_kept_is_what_autograd_saves_on_cpu(make: Any, args: Any) -> None:
    torch.manual_seed(0)
    model = make().train()
    graph, real = autograd_saves(model, args())
    assert kept_bytes(graph, B) == pytest.approx(real, rel=0.01)
    # every output of every kernel, what the estimate counted before, is far off
    outputs = sum(v.numel(B) * 4 for v in graph.values.values()
                  if v.producer is not None and v.dtype == "float32")
    assert abs(outputs - real) > 0.2 * real


class HFLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _hf(name: str) -> nn.Module:
    """A two-layer GPT-2 or BERT from transformers (attention dropout on: the CPU's math path)."""
    import transformers as tf

    if name == "gpt2":
        return HFLoss(tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                       vocab_size=1000, n_positions=64)))
    return HFLoss(tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=64,
                                                   num_attention_heads=4, intermediate_size=256,
                                                   vocab_size=1000)))


@pytest.mark.parametrize("make,args", [
    (TanhGelu, lambda: (torch.randn(B, S, H),)),
    (Block, lambda: (torch.randn(B, S, H),)),
    (Head, lambda: (torch.randint(0, 100, (B, S)),)),
    (lambda: _hf("gpt2"), lambda: (torch.randint(0, 1000, (B, 32)),)),
    (lambda: _hf("bert"), lambda: (torch.randint(0, 1000, (B, 32)),)),
], ids=["tanh_gelu", "block", "head", "gpt2", "bert"])
def test_kept_under_autocast_is_what_autograd_saves_on_cpu(make: Any, args: Any) -> None:
    """Under bfloat16 autocast a captured graph holds no casts: `linear` of float32 tensors
    gives bfloat16. Autograd saves the products' bfloat16 casts of their float32 inputs (one
    per product), float32 where an op computes half inputs in float32 (cross-entropy's
    log-softmax, the attention math path's matrices), and one bfloat16 copy per weight a
    product reads where its input needs a gradient, which autocast's cache shares among the
    microbatches of a call (`autocast_copies`, counted with the parameters). Reading the
    graph as if it ran in float32 (before) kept 0.71x to 0.95x of these activations, and no
    weight copy."""
    torch.manual_seed(0)
    graph, acts, casts = autograd_saves_under_autocast(make().train(), args())
    batch = args()[0].shape[0]
    assert kept_bytes(graph, batch) == pytest.approx(acts, rel=0.01)
    assert sum(autocast_copies(graph).values()) == casts


def test_a_tanh_gelu_keeps_four_of_its_eight_results() -> None:
    """x (pow's input, viewed from fc's output), tanh's result and the two factors of the last
    multiply; proj keeps its input: five (B, S, 4H) tensors in all."""
    graph, _ = autograd_saves(TanhGelu().train(), (torch.randn(B, S, H),))
    assert kept_bytes(graph, B) == 5 * B * S * 4 * H * 4


def test_views_and_no_op_conversions_share_their_base() -> None:
    graph, _ = autograd_saves(Block().train(), (torch.randn(B, S, H),))
    base = bases(graph)
    by_op = {t.op: t for t in graph.tasks}
    split = by_op["aten.split.Tensor"]
    assert {base[v] for v in split.outputs} == {base[split.inputs[0]]}
    conv = by_op["aten.to.dtype"]  # float32 to float32 returns its input
    assert base[conv.outputs[0]] == base[conv.inputs[0]]
    # contiguous() of a transposed view copies: a new base
    cont = by_op["aten.contiguous.default"]
    assert base[cont.outputs[0]] == cont.outputs[0]


def test_nothing_is_kept_where_no_gradient_flows() -> None:
    class Frozen(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x * 2.0).sum()

    cap = capture(Frozen(), (torch.randn(B, H),), {})
    assert not requires_grad(cap.graph)
    assert kept_bytes(cap.graph, B) == 0


def test_fused_kernels_keep_less_and_the_cpu_is_not_fused() -> None:
    """CUDA's fused dropout keeps a one-byte mask and fused attention no attention matrix."""
    graph, _ = autograd_saves(Block().train(), (torch.randn(B, S, H),))
    assert kept_bytes(graph, B, fused=True) < kept_bytes(graph, B, fused=False)
    assert not runs_fused_kernels(Cluster([DeviceSpec("local-cpu", 1e9, 1e9, 1e9)]))
    assert runs_fused_kernels(Cluster.homogeneous("H100", n=2, per_node=2))


def test_backward_work_of_the_loss_holds_two_logit_sized_gradients() -> None:
    """Cross-entropy's backward makes the log-softmax's gradient and then the logits', both
    alive at once: GraphCosts' working memory of the loss is twice the logits."""
    model = Head().train()
    cap = capture(model, (torch.randint(0, 100, (B, S)),), {})
    costs = GraphCosts.of(cap.graph, atomic_components(cap.graph), fused=False)
    t = next(i for i, task in enumerate(cap.graph.tasks) if "cross_entropy" in task.op)
    assert costs.work[t, 0] + costs.work[t, 1] * B >= 2 * B * S * 100 * 4


def test_one_rule_says_which_devices_run_fused_kernels() -> None:
    """The planner asks with DeviceSpec names, the runtime with torch device types: one rule,
    so that both drop the same recipes (any device but a CPU runs fused attention)."""
    from rannc.profile.device import KNOWN_DEVICES
    from rannc.profile.saved import fused_kernels

    assert [fused_kernels(d) for d in ("cpu", "local-cpu", "cuda", "xpu", "H100")] == [
        False, False, True, True, True]
    h100 = KNOWN_DEVICES["H100"]
    cpu = dataclasses.replace(h100, name="local-cpu")
    assert runs_fused_kernels(Cluster.homogeneous(h100, n=2, per_node=2))
    assert not runs_fused_kernels(Cluster([h100, cpu], per_node=2))


class MaskedAttention(nn.Module):
    """Attention without dropout (the CPU runs its fused flash kernel) under a padding mask
    computed from the data: a boolean (batch, 1, S, S) mask, or the same as an additive bias."""

    def __init__(self, float_mask: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.float_mask = float_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(x.shape[0], S, 2, H // 2).transpose(1, 2)
                   for t in self.qkv(x).split(H, dim=-1))
        keys = (x[:, :, 0] > -1.0)[:, None, None, :].expand(-1, 1, S, -1)  # (from the data)
        mask = torch.zeros(keys.shape).masked_fill(~keys, -1e4) if self.float_mask else keys
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "float"])
def test_a_fused_kernel_keeps_a_boolean_mask_as_a_bias_in_the_query_dtype(float_mask: bool) -> None:
    """The fused kernels (this CPU's flash, the H100's memory-efficient and cuDNN ones:
    benchmarks/attention_probe.py) convert a boolean mask to an additive bias of its shape in
    q's dtype and keep it for backward, one per call; a float mask is kept as it is."""
    torch.manual_seed(0)
    graph, real = autograd_saves(MaskedAttention(float_mask), (torch.randn(B, S, H),))
    assert real == pytest.approx(kept_bytes(graph, B, fused=True), rel=0.01)
    if not float_mask:  # (the bias, float32 B x 1 x S x S, is most of what it keeps)
        assert real > B * S * S * 4


class EmbedsGPT2(nn.Module):
    """A two-layer GPT-2 fed embeddings: a later pipeline stage, whose input needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        self.model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                      vocab_size=1000, n_positions=64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).logits


def _stash_of_split_backward(model: nn.Module, x: torch.Tensor) -> tuple[TaskGraph, float]:
    """The captured graph, and the bytes the runtime's input pass (B) keeps for the weight pass
    (W) running it once with x needing a gradient (distinct storages)."""
    from rannc.pipeline.split_backward import backward_input

    x.requires_grad_(True)
    cap, ph = captured(model, (x,))
    out = cap.gm(*ph)
    out = out[0] if isinstance(out, (tuple, list)) else out
    wp = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    seen: dict[int, int] = {}
    grads = [g for gs in wp.kept.values() for g in gs if g is not None]
    grads += [g for grp in wp.groups for g in grp.grads]
    for g in grads:
        seen[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    wp.run()
    return cap.graph, float(sum(seen.values()))


# (not TanhGelu: its `.sum()` output gets an expanded scalar gradient of 4 bytes, where a
# stage's outputs get full gradients from the next stage)
@pytest.mark.parametrize("make,rows", [(Block, B), (EmbedsGPT2, 2)], ids=["block", "gpt2"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_stash_is_what_the_input_pass_keeps_for_the_weight_pass(
        make: Any, rows: int, autocast: bool) -> None:
    # zero-bubble schedules hold these gradients for every microbatch whose W is deferred, on
    # top of its activations; the memory model counts them (`memory_terms`' stash)
    from rannc.profile.saved import wgrad_stash

    torch.manual_seed(0)
    h = 64 if make is EmbedsGPT2 else H
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        graph, got = _stash_of_split_backward(make(), torch.randn(rows, S, h))
    st = wgrad_stash(graph, inputs_need_grad=True)
    want = float((st[:, 0] + st[:, 1] * rows).sum())
    assert got > 0
    assert want == pytest.approx(got, rel=0.02)


def _graph_saved_bytes(root: Any, skip: set[int]) -> int:
    """Bytes of the distinct storages the autograd graph below `root` still keeps for
    backward (those at the addresses `skip` left out; released ones cannot be read)."""
    seen, todo, kept = set(), [root], {}
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for a in dir(node):
            if not a.startswith("_raw_saved_"):
                continue
            try:
                got = getattr(node, a[len("_raw"):])
            except RuntimeError:  # released after B
                continue
            for t in got if isinstance(got, (list, tuple)) else (got,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                    kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        todo += [n for n, _ in node.next_functions]
    return sum(kept.values())


@pytest.mark.parametrize("make,rows", [(Block, B), (EmbedsGPT2, 2)], ids=["block", "gpt2"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_what_only_the_input_pass_reads_is_what_the_runtime_releases_after_it(
        make: Any, rows: int, autocast: bool) -> None:
    # between B and W a microbatch holds its kept activations less these (`memory_terms`)
    from rannc.pipeline.split_backward import backward_input
    from rannc.profile.saved import b_only

    torch.manual_seed(0)
    model = make()
    x = torch.randn(rows, S, 64 if make is EmbedsGPT2 else H, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        cap, ph = captured(model, (x,))
        out = cap.gm(*ph)
    out = out[0] if isinstance(out, (tuple, list)) else out
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    before = _graph_saved_bytes(out.grad_fn, skip)
    wp = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    after = _graph_saved_bytes(out.grad_fn, skip)
    wp.run()  # (W still runs: nothing it reads was released)
    bo = b_only(cap.graph, fused=False, inputs_need_grad=True)
    want = float((bo[:, 0] + bo[:, 1] * rows).sum())
    assert before - after > 0.35 * before  # attention, GELU inputs, masks
    assert want == pytest.approx(before - after, rel=0.01)
