"""The backward split into B (stage-input gradients) and W (weight gradients) that zero-bubble
schedules run apart (`rannc.pipeline.split_backward`): B then W gives what one full backward
gives, bit for bit, on graphs whose weight paths meet the input path in every way the stages
of real models have (residuals, shared weights, weights reaching an output directly, inputs
that need no gradient), and W accumulates once per weight, firing post-accumulate-grad hooks
as the gradient reducer expects."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from torch import nn

from rannc.pipeline.split_backward import backward_input

pytestmark = pytest.mark.layer("pure")


class Block(nn.Module):
    """A pre-norm transformer-like block: meeting nodes below other meeting nodes (residuals)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * self.gate
        return h, h.sum(-1) + self.gate.sum()  # a second output; the gate also reaches it directly


class Tied(nn.Module):
    """One weight used twice (tied embedding and head) and a weight only the output reads."""

    def __init__(self, d: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.mix(self.emb(ids) + x)
        logits = h @ self.emb.weight.t()
        return logits, self.scale * 3.0  # an output that no input reaches


class Reused(nn.Module):
    """One layer applied twice on the input path: its weight's two meeting nodes have the
    input path between them, so their W roots share a group."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin, self.other = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.lin(torch.tanh(self.lin(x))))


Case = Callable[[], tuple[nn.Module, list[torch.Tensor], list[bool]]]  # model, inputs, wants grad

CASES: dict[str, Case] = {
    "block": lambda: (Block(), [torch.randn(4, 8)], [True]),
    "mlp_first_stage": lambda: (nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)),
                                [torch.randn(5, 8)], [False]),  # inputs need no gradient
    "tied": lambda: (Tied(), [torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 8)], [False, True]),
    "reused": lambda: (Reused(), [torch.randn(4, 8)], [True]),
}


def _run(model: nn.Module, ins: list[torch.Tensor], wants: list[bool], split: bool
         ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor], dict[str, int]]:
    leaves = [x.clone().requires_grad_(w) for x, w in zip(ins, wants, strict=True)]
    hits: dict[str, int] = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: hits.__setitem__(n, hits.get(n, 0) + 1))
    outs = model(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outs]
    if split:
        wp = backward_input(outs, grads, [x for x in leaves if x.requires_grad],
                            list(model.parameters()))
        assert all(p.grad is None for p in model.parameters())  # B leaves the weights alone
        grouped = [id(w) for g in wp.groups for w in g.weights]
        assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each in one group
        in_grads = [x.grad for x in leaves]
        wp.run()
    else:
        torch.autograd.backward(outs, grads)
        in_grads = [x.grad for x in leaves]
    return in_grads, {n: p.grad for n, p in model.named_parameters()}, hits


@pytest.mark.parametrize("name", CASES)
def test_b_then_w_is_the_full_backward_bit_for_bit(name: str) -> None:
    torch.manual_seed(0)
    model, ins, wants = CASES[name]()
    ref_model = copy.deepcopy(model)
    ref_in, ref_w, ref_hits = _run(ref_model, ins, wants, split=False)
    got_in, got_w, got_hits = _run(model, ins, wants, split=True)
    for a, b in zip(ref_in, got_in, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    assert ref_w.keys() == got_w.keys()
    for n in ref_w:
        assert got_w[n] is not None, n
        assert torch.equal(ref_w[n], got_w[n]), n
    assert got_hits == ref_hits  # one accumulation per weight, as in one full backward
    assert all(v == 1 for v in got_hits.values())


def test_b_twice_then_w_twice_accumulates_like_two_backwards() -> None:
    """Two microbatches, their W passes deferred past the second B (ZB-H1's order)."""
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    xs = [torch.randn(4, 8) for _ in range(2)]
    for x in xs:
        out = ref(x.clone().requires_grad_())
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    passes = []
    for x in xs:
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        passes.append(backward_input(out, [torch.ones_like(o) for o in out], [leaf],
                                     list(model.parameters())))
    for wp in passes:
        wp.run()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)


def test_nothing_to_do_without_gradients() -> None:
    model = nn.Linear(3, 3)
    out = model(torch.randn(2, 3))
    wp = backward_input([out], [None], [], list(model.parameters()))
    wp.run()
    assert model.weight.grad is None


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its runs: a node on the input path only."""

    runs = 0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        _Counted.runs += 1
        return g


def test_w_runs_no_input_gradient_node_again() -> None:
    """W walks from each meeting node to its own weights only: the input-gradient nodes between
    two layers run once, in B (one call from every meeting node would run them again in W)."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    ref = copy.deepcopy((first, second))
    x = torch.randn(4, 8)
    torch.autograd.backward(ref[1](_Counted.apply(ref[0](x.clone().requires_grad_()))).sum())
    leaf = x.clone().requires_grad_()
    out = second(_Counted.apply(first(leaf)))
    _Counted.runs = 0
    wp = backward_input([out], [torch.ones_like(out)], [leaf],
                        [*first.parameters(), *second.parameters()])
    assert _Counted.runs == 1
    wp.run()
    assert _Counted.runs == 1
    for p, q in zip([*first.parameters(), *second.parameters()],
                    [*ref[0].parameters(), *ref[1].parameters()], strict=True):
        assert torch.equal(p.grad, q.grad)


def test_w_under_saved_tensor_hooks_keeps_nothing() -> None:
    """Saved-tensor hooks that keep the tensor itself tie each node to its saved output in a
    cycle only a releasing walk breaks: under them W walks the input path again, so nothing
    stays once the pass and the outputs are dropped."""
    live: list[int] = [0]

    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t
            live[0] += 1

        def __del__(self) -> None:
            live[0] -= 1

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 8))  # softmax saves its output
    leaf = torch.randn(4, 8).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(Box, lambda b: b.t):
        out = model(leaf)
        wp = backward_input([out], [torch.ones_like(out)], [leaf], list(model.parameters()))
        wp.run()
    del out, wp
    gc.collect()
    assert live[0] == 0


def _node(root: object, name: str) -> object:
    todo, seen = [root], set()
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == name:
            return n
        todo += [m for m, _ in n.next_functions]  # type: ignore[attr-defined]
    raise AssertionError(name)


def _softmax_between_layers() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Two linears with a softmax between (it saves its output, which only B reads), a copy
    whose gradients one full backward gave, and an input leaf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    ref(x.clone().requires_grad_()).sum().backward()
    return model, ref, x.clone().requires_grad_()


def test_b_releases_what_only_it_reads_and_w_keeps_the_layers_inputs() -> None:
    """After B a microbatch holds what W reads: the softmax's output (read by B alone) is
    released, the second layer's input (the meeting node's, read by W) is not; W's gradients
    are those of one full backward."""
    model, ref, leaf = _softmax_between_layers()
    out = model(leaf)
    soft, second = _node(out.grad_fn, "SoftmaxBackward0"), out.grad_fn
    wp = backward_input([out], [torch.ones_like(out)], [leaf], list(model.parameters()))
    with pytest.raises(RuntimeError):
        _ = soft._saved_result  # type: ignore[attr-defined]
    assert second._saved_mat1.shape == (4, 8)  # type: ignore[attr-defined]
    wp.run()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_b_leaves_tensors_saved_under_hooks_alone() -> None:
    """Tensors packed by saved-tensor hooks at forward (selective recomputation's recipes)
    have hooks of their own: B cannot release them, and W still reads them."""
    model, ref, leaf = _softmax_between_layers()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (t,), lambda p: p[0]):
        out = model(leaf)
    soft = _node(out.grad_fn, "SoftmaxBackward0")
    wp = backward_input([out], [torch.ones_like(out)], [leaf], list(model.parameters()))
    assert soft._saved_result.shape == (4, 8)  # type: ignore[attr-defined]
    wp.run()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
