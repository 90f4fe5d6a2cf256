"""RaNNCModule in one process equals the unwrapped model: outputs, gradients, AdamW steps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from model_zoo import BUILDERS, make_case
from torch import nn

import rannc

pytestmark = pytest.mark.layer("single_process")

RTOL, ATOL = 1e-6, 1e-7
# Llama: the capture (torch.export) builds the causal mask as a tensor, so Hugging Face's SDPA
# path repeats the key/value heads (repeat_kv) where the eager model passes enable_gqa=True
# without a mask: the same sums in another order, 1.5e-8 apart in the value projection's
# gradient after one backward, grown by AdamW (eps 1e-8) to 2.7e-7 on the logits by step 3.
LOOSER = {"llama": (1e-5, 1e-6)}


def assert_tree_close(a: object, b: object, rtol: float = RTOL, atol: float = ATOL) -> None:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert str(sa) == str(sb), f"output structure differs: {sa} vs {sb}"
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        else:
            assert x == y


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_forward_backward_and_adamw_steps(name: str) -> None:
    case = make_case(name)
    rtol, atol = LOOSER.get(name, (RTOL, ATOL))
    ref = copy.deepcopy(case.model)
    wrapped = rannc.RaNNCModule(case.model)
    opt_w = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        out_w = wrapped(*case.args, **case.kwargs)
        out_r = ref(*case.args, **case.kwargs)
        assert type(out_w) is type(out_r)
        assert_tree_close(out_w, out_r, rtol, atol)
        case.loss(out_w).backward()
        case.loss(out_r).backward()
        for (n, p), (_, q) in zip(wrapped.named_parameters(), ref.named_parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=f"{n} step {step}")
        opt_w.step()
        opt_r.step()
        opt_w.zero_grad()
        opt_r.zero_grad()
    for (n, p), (_, q) in zip(wrapped.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=n)
    assert list(wrapped.state_dict()) == list(ref.state_dict())


def test_state_dict_keeps_names_and_loads_into_unwrapped_model() -> None:
    case = make_case("bert")
    wrapped = rannc.RaNNCModule(case.model)
    wrapped(*case.args, **case.kwargs)
    fresh = make_case("bert", seed=1).model
    fresh.load_state_dict(wrapped.state_dict())
    assert "cls.predictions.decoder.weight" in wrapped.state_dict()
    assert all(not n.startswith("model.") for n, _ in wrapped.named_parameters())


def test_new_sequence_length_recaptures_and_smaller_batch_reuses() -> None:
    case = make_case("gpt2", batch=4)
    ref = copy.deepcopy(case.model)
    wrapped = rannc.RaNNCModule(case.model)
    wrapped(**case.kwargs)
    ids3 = case.kwargs["input_ids"][:3]
    assert_tree_close(wrapped(input_ids=ids3, labels=ids3), ref(input_ids=ids3, labels=ids3))
    assert len(wrapped._deployments) == 1  # a smaller batch reuses the capture
    ids1 = case.kwargs["input_ids"][:1, :6]
    assert_tree_close(wrapped(input_ids=ids1, labels=ids1), ref(input_ids=ids1, labels=ids1))
    assert len(wrapped._deployments) == 2


def test_batchnorm_statistics_updated_like_the_original() -> None:
    case = make_case("resnet")
    ref = copy.deepcopy(case.model)
    wrapped = rannc.RaNNCModule(case.model)
    for _ in range(2):
        wrapped(*case.args)
        ref(*case.args)
    for (n, b), (_, c) in zip(wrapped.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=RTOL, atol=ATOL, msg=n)


def test_eval_mode_and_no_grad() -> None:
    case = make_case("resnet")
    ref = copy.deepcopy(case.model).eval()
    wrapped = rannc.RaNNCModule(case.model).eval()
    with torch.no_grad():
        assert_tree_close(wrapped(*case.args), ref(*case.args))


def test_a_submodule_in_the_other_mode_is_captured_as_it_is() -> None:
    """BatchNorm frozen with .eval() under model.train(), then trained again, and dropout kept
    on under model.eval() (Monte Carlo dropout): each combination of modes runs the graph
    captured in it (before, the first capture kept running: batch statistics for a frozen
    BatchNorm, its running buffers updated)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    for step, (train, bn_train, dropout_train) in enumerate(
            [(True, True, True), (True, False, True), (True, True, True), (False, False, True)]):
        wrapped.train(train)
        ref.train(train)
        for m in (model, ref):
            m[1].train(bn_train)
            m[2].train(dropout_train)
        x = torch.randn(6, 4)
        torch.manual_seed(step)
        got = wrapped(x)
        torch.manual_seed(step)
        want = ref(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, s=step: f"step {s}: {m}")
        if train:
            got.sum().backward()
            want.sum().backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
        for (n, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b, c, rtol=0, atol=0, msg=n)


@pytest.mark.layer("pure")
def test_released_parameter_memory_goes_back_to_the_os() -> None:
    """After a rank releases the parameters it does not hold, rannc trims the C heap: the
    ~1 MB parameter blocks glibc kept would otherwise stay resident (benchmarks/capacity.py)."""
    from rannc.deploy import return_freed_heap

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024

    # As while a model is built: once a large block was freed, glibc raises its mmap threshold
    # and serves 1 MiB tensors from the heap, which free() keeps (without the trim, RSS stays).
    big = torch.ones(1024, 4096)
    del big
    blocks = [torch.ones(256, 1024) for _ in range(160)]  # 160 MiB in 1 MiB tensors
    full = rss_mib()
    for b in blocks:
        b.set_(torch.empty(0))
    del blocks
    return_freed_heap()
    assert rss_mib() < full - 100, (full, rss_mib())


def test_a_parameter_replaced_between_calls_is_used() -> None:
    """A call binds the graph to the model's parameters as they are now (rannc keeps the
    lookup between calls, `ModelState`): one assigned anew is read, and gets the gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(5, 4)
    wrapped(x).sum().backward()
    new = torch.nn.Parameter(torch.randn(2, 3))
    model[2].weight = new
    ref[2].weight = torch.nn.Parameter(new.detach().clone())
    out = wrapped(x)
    torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
    out.sum().backward()
    ref(x).sum().backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, ref[2].weight.grad, rtol=RTOL, atol=ATOL)


def test_a_model_converted_to_another_dtype_after_a_call_is_captured_again() -> None:
    """`model.to(torch.bfloat16)` after a call (training on in lower precision, or evaluation
    in it): the graph captured in float32 casts to the dtypes it was captured with (Llama's
    RMSNorm: `x.to(input_dtype)`), so the call captures again (before: "Tensor dtype
    mismatch" inside the graph); converted back, the first capture runs again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    ids = torch.randint(0, 64, (3, 8))
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        for m in (wrapped, ref):
            m.to(dtype)
            m.zero_grad()
        out, want = wrapped(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        assert out.logits.dtype == want.logits.dtype == dtype
        tol = LOOSER["llama"] if dtype == torch.float32 else (1e-2, 1e-3)  # (repeat_kv, above)
        torch.testing.assert_close(out.logits, want.logits, rtol=tol[0], atol=tol[1])
        out.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol[0], atol=tol[1],
                                       msg=lambda m, n=name, d=dtype: f"{n} {d}: {m}")
    assert len(wrapped._deployments) == 2


def test_dropout_draws_what_the_unwrapped_model_draws() -> None:
    """In one process the captured graph's dropout masks are the unwrapped model's, call for
    call from the same generator state (README, Semantics: random ops)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)
    cfg._attn_implementation = "eager"
    model = BertForMaskedLM(cfg).train()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    ids = torch.randint(2, 64, (4, 12))
    wrapped(input_ids=ids)  # capture and deploy
    for seed in (5, 6):
        torch.manual_seed(seed)
        got = wrapped(input_ids=ids)["logits"]
        torch.manual_seed(seed)
        want = ref(input_ids=ids).logits
        assert not torch.equal(want, ref.eval()(input_ids=ids).logits)  # dropout did act
        ref.train()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _MaskedEncoder(nn.Module):
    """torch's nn.TransformerEncoder given the attention mask as an input (batch-first)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=mask)


def test_torch_encoder_applies_any_mask_it_is_given() -> None:
    """nn.TransformerEncoder given a mask compares it with a causal mask to choose its kernel
    (before: "Could not guard on data-dependent expression", no capture). The graph applies the
    mask as given, so a causal mask and then a banded one of the same shape (the same capture)
    each give the unwrapped model's outputs and gradients."""
    torch.manual_seed(0)
    model = _MaskedEncoder()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    seq = 6
    causal = nn.Transformer.generate_square_subsequent_mask(seq)
    near = (torch.arange(seq)[:, None] - torch.arange(seq)[None, :]).abs() > 1
    banded = torch.zeros(seq, seq).masked_fill(near, float("-inf"))
    x = torch.randn(3, seq, 16)
    for mask in (causal, banded):
        out, want = wrapped(x, mask), ref(x, mask)
        torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
        out.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
            p.grad = q.grad = None
    assert len(wrapped._deployments) == 1


class _PaddedEncoder(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=pad)


@pytest.mark.parametrize("nested", [True, False])
def test_torch_encoder_in_eval_with_padding_warns_of_its_fast_path(nested: bool) -> None:
    """In eval under no_grad, nn.TransformerEncoder (nested tensors enabled, its default)
    leaves zeros at the padded positions; rannc's graph computes them as training does, and
    says so once. Unpadded positions are equal; with enable_nested_tensor=False every one is."""
    torch.manual_seed(0)
    model = _PaddedEncoder(nested).eval()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, want = wrapped(x, pad), ref(x, pad)
    warned = [w for w in caught if "nested-tensor fast path" in str(w.message)]
    assert len(warned) == (1 if nested else 0)
    if nested:
        assert "'encoder'" in str(warned[0].message)
        assert "enable_nested_tensor=False" in str(warned[0].message)
        assert torch.count_nonzero(want[pad]) == 0 and torch.count_nonzero(out[pad]) > 0
    torch.testing.assert_close(out[~pad], want[~pad], rtol=1e-5, atol=1e-6)
    if not nested:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_gathered_parameters_in_one_process_runs_the_block_as_it_is() -> None:
    """In one process every parameter is here: the block runs as it is (re-initialising
    through it equals the unwrapped model's), and a rank that does not exist is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(3, 4)
    wrapped(x)
    with wrapped.gathered_parameters(modifier_rank=0):
        torch.manual_seed(1)
        wrapped.module.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
    torch.manual_seed(1)
    ref.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
    torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
    with pytest.raises(rannc.RaNNCError, match=r"modifier_rank=1.*ranks are 0 to 0"):
        with wrapped.gathered_parameters(modifier_rank=1):
            pass
