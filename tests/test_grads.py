"""The gradient reducer in one process (a one-rank gloo group, so a sum is the gradient itself):
buckets start during the last backward, in order, with at most one bucket's buffer beyond the
gradients; a parameter accumulated twice waits for both; no_sync keeps local sums; a parameter
without a gradient keeps None. Exactness across ranks is in test_pipeline_mpi.py."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rannc
from rannc.errors import ConfigError
from rannc.pipeline.grads import BucketBuffers, GradReducer, LossSeed, not_finite

pytestmark = pytest.mark.layer("single_process")


@pytest.fixture(scope="module")
def group() -> Iterator[object]:
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0])
    if started:
        dist.destroy_process_group()


def _mlp(width: int = 16, depth: int = 12) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _count_all_reduces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The numel of every all-reduce from here on, in order."""
    calls: list[int] = []
    real = dist.all_reduce

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(t.numel())
        return real(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    return calls


def _reducer(model: nn.Module, group: object, bucket_bytes: int,
             accumulations: int = 1, buffers: BucketBuffers | None = None) -> GradReducer:
    held = dict(model.named_parameters())
    return GradReducer(held, [((0,), list(held), group)], {n: i for i, n in enumerate(held)},
                       bucket_bytes, {id(p): accumulations for p in held.values()},
                       buffers=buffers)


def test_buckets_start_in_backward_with_at_most_one_bucket_beyond_the_gradients(group: object) -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    ref(x).square().sum().backward()
    red = _reducer(model, group, bucket_bytes=1200)  # a weight and its bias
    buckets = red.groups[0].buckets
    assert len(buckets) > 10
    red.begin()
    red.arm()
    model(x).square().sum().backward()
    # the first starts in backward; later ones when the one buffer in use is free again
    assert red.groups[0].started >= 1
    red.finish(sync=True)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    assert all(b.numel * 4 <= 1200 for b in buckets if not b.in_place)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < red.peak_extra_bytes <= 1200 < total / 8
    assert red.extra_bytes == 0


def test_gradients_add_to_what_grad_held_and_no_sync_keeps_local_sums(group: object) -> None:
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    xs = [torch.randn(3, 16) for _ in range(3)]
    for x in xs:
        ref(x).sum().backward()
    red = _reducer(model, group, bucket_bytes=256)
    model(xs[0]).sum().backward()  # a backward outside rannc's reduction: kept and added to
    for i, x in enumerate(xs[1:]):
        red.begin()
        red.arm()
        model(x).sum().backward()
        red.finish(sync=i == 1)
        assert bool(red.pending) == (i == 0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


@pytest.mark.parametrize("in_place", [False, True])
def test_an_accumulation_adds_up_in_one_gradient_tensor_per_parameter(group: object,
                                                                      in_place: bool) -> None:
    """no_sync() backwards and the synchronised one after them add up in the `.grad` the first
    one made, in place (as autograd accumulates under DDP), so a rank holds one gradient per
    parameter between the calls, not the local sums a second time; same values bit for bit.
    `in_place` (fill-drain's backward, run for its real loss gradient): autograd adds into that
    `.grad` during the backward itself, which holds no second copy alongside either."""
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    xs = [torch.randn(3, 16) for _ in range(4)]
    for x in xs:
        ref(x).sum().backward()
    red = _reducer(model, group, bucket_bytes=256)
    first: dict[str, torch.Tensor] = {}
    for i, x in enumerate(xs):
        sync = i == len(xs) - 1
        red.begin(in_place=in_place)
        if sync:  # (as the runtime: buckets start during a synchronised backward only)
            red.arm()
        model(x).sum().backward()
        if i > 0:  # during the backward: the pending sum itself, or a new tensor beside it
            assert all((p.grad is first[n]) == in_place for n, p in model.named_parameters()), i
        red.finish(sync=sync)
        for n, p in model.named_parameters():
            assert p.grad is first.setdefault(n, p.grad), (i, n)
            assert i == len(xs) - 1 or red.pending[n] is p.grad, (i, n)
    assert not red.pending
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_no_sync_drops_the_local_sums(group: object, set_to_none: bool) -> None:
    """An accumulation given up: the next synchronised backward reduces its own gradients only
    (DDP reduces what `.grad` holds), whether zero_grad() set `.grad` to None or zeroed it."""
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    xs = [torch.randn(3, 16) for _ in range(2)]
    ref(xs[1]).sum().backward()
    red = _reducer(model, group, bucket_bytes=256)
    for i, x in enumerate(xs):
        if i == 1:
            model.zero_grad(set_to_none=set_to_none)
        red.begin()
        red.arm()
        model(x).sum().backward()
        red.finish(sync=i == 1)
    assert not red.pending
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_a_parameter_accumulated_twice_is_reduced_after_the_second(group: object) -> None:
    # v is read first, so its bucket is the last one, which `finish` starts (no hook): w's is
    # the first, started from w's hook once both accumulations are in
    v, w = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    model = nn.Module()
    model.v, model.w = v, w
    red = _reducer(model, group, bucket_bytes=1, accumulations=2)
    assert [b.names for b in red.groups[0].buckets] == [["w"], ["v"]]
    red.begin()
    red.arm()
    x = torch.randn(2, 4)
    (x @ w).sum().backward()  # e.g. the kept part's backward
    assert red.groups[0].started == 0
    (x @ w).square().sum().backward()  # the recomputed part's
    assert red.groups[0].started == 1
    red.finish(sync=True)
    assert red.groups[0].started == 2 and v.grad is None
    w2 = w.detach().clone().requires_grad_(True)
    ((x @ w2).sum() + (x @ w2).square().sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_the_last_bucket_has_no_hooks_and_starts_in_finish(group: object) -> None:
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 16)
    ref(x).sum().backward()
    one = _reducer(model, group, bucket_bytes=1 << 20)  # every gradient in one bucket
    one.begin()
    one.arm()
    assert not one._hooks
    model(x).sum().backward()
    assert one.groups[0].started == 0
    one.finish(sync=True)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    several = _reducer(model, group, bucket_bytes=256)
    last = several.groups[0].buckets[-1]
    several.begin()
    several.arm()
    assert len(several._hooks) == len(several.held) - len(last.names)
    several.finish(sync=False)


def test_a_parameter_without_a_gradient_keeps_none(group: object) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    red = _reducer(model, group, bucket_bytes=1 << 20)
    red.begin()
    red.arm()
    model[0](torch.randn(2, 4)).sum().backward()
    red.finish(sync=True)
    assert model[0].weight.grad is not None and model[1].weight.grad is None


def test_a_frozen_parameter_is_held_without_a_hook(group: object) -> None:
    # Whisper's positional embeddings are frozen (requires_grad=False): registering the
    # post-accumulate hook on one raised in the last backward (the conformance suite's
    # 3r-rep21-m2-gpipe whisper cell).
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    red = _reducer(model, group, bucket_bytes=1 << 20)
    red.begin()
    red.arm()
    model(torch.randn(2, 4)).sum().backward()
    red.finish(sync=True)
    assert model[0].weight.grad is None and model[1].weight.grad is not None


def test_a_unit_backward_is_scaled_after_the_sum_and_before_the_old_grad(group: object) -> None:
    """An eager schedule runs backward for a unit loss gradient and starts the buckets inside
    forward(); `finish(scale=g)` then gives g x (sum) + what .grad held before."""
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    x0, x1 = torch.randn(3, 16), torch.randn(3, 16)
    ref(x0).sum().backward()
    (ref(x1).sum() * 0.5).backward()
    model(x0).sum().backward()  # accumulated before: not scaled
    red = _reducer(model, group, bucket_bytes=256)
    red.begin()
    red.arm()
    model(x1).sum().backward()
    red.finish(sync=True, scale=torch.tensor(0.5, dtype=torch.float64))
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_an_eager_line_hands_its_gradients_over_before_grad_is_restored(group: object) -> None:
    """An eager schedule's forward() runs the backward, starts the buckets (`prepare_rest`) and
    puts back what .grad held before; backward() then finishes the sums from what it took."""
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 16)
    ref(x).sum().backward()
    red = _reducer(model, group, bucket_bytes=1 << 20)  # one bucket, started by prepare_rest
    red.begin()
    model(x).sum().backward()  # (no arm: every gradient taken at the end of the line)
    red.prepare_rest()
    assert red.groups[0].started == 1
    for p in model.parameters():
        p.grad = None  # forward() restores .grad until backward() commits
    red.finish(sync=True)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_the_input_signatures_reducers_share_one_buffer_and_a_pending_bucket_keeps_its_sums(
        group: object) -> None:
    """Every input signature has a reducer of its own; they fill one kept buffer (the memory
    model counts one: a buffer each held up to max_captures). An eager forward whose bucket is
    still in the buffer when another signature's backward begins finishes its buckets first
    (in order, as the shared process groups need), so its backward() still reduces its own
    gradients, not the other's."""
    model = _mlp(depth=3)
    ref_a, ref_b = copy.deepcopy(model), copy.deepcopy(model)
    xa, xb = torch.randn(3, 16), torch.randn(5, 16)
    ref_a(xa).sum().backward()
    ref_b(xb).square().sum().backward()
    buffers = BucketBuffers()
    red_a = _reducer(model, group, bucket_bytes=1 << 20, buffers=buffers)  # one bucket each
    red_b = _reducer(model, group, bucket_bytes=1 << 20, buffers=buffers)
    red_a.begin()  # signature a: an eager line, its bucket started in forward()
    model(xa).sum().backward()
    red_a.prepare_rest()
    stash_a = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    red_b.begin()  # signature b: a whole backward in between, in the same buffer
    # (a's buckets all started and summed first, in order, as the shared groups need)
    assert red_a.groups[0].started == len(red_a.groups[0].buckets)
    assert all(b.work is None for b in red_a.groups[0].buckets)
    red_b.arm()
    model(xb).square().sum().backward()
    red_b.finish(sync=True)
    for (n, p), q in zip(model.named_parameters(), ref_b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    for p in model.parameters():
        p.grad = None
    red_a.finish(sync=True)  # a's backward() after all: its own sums
    for (n, _p), q in zip(model.named_parameters(), ref_a.parameters(), strict=True):
        torch.testing.assert_close(stash_a[n], q.grad, rtol=0, atol=0, msg=n)
    a_buf = red_a.groups[0].buckets[0].spare
    assert a_buf is not None and a_buf is red_b.groups[0].buckets[0].spare


def test_an_overflow_elsewhere_marks_this_ranks_first_gradient(group: object) -> None:
    """The overflow flag already agreed (it travelled with the loss gradient's all-reduce):
    `finish` marks the first gradient without meeting the other ranks again."""
    model = _mlp(depth=2)
    red = _reducer(model, group, bucket_bytes=1 << 20)
    red.begin()
    model(torch.randn(3, 16)).sum().backward()
    red.finish(sync=True, overflow=(True, False))
    first = next(iter(model.parameters())).grad
    assert first is not None and not bool(torch.isfinite(first).all())
    assert all(bool(torch.isfinite(p.grad).all()) for p in list(model.parameters())[1:])


def test_pure_data_parallelism_with_rows_on_every_replica_meets_no_more_after_the_buckets(
        group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank holds every parameter and every replica computed rows (`same_got`): the
    got-a-gradient flags are the same on every rank and a non-finite sum shows on every rank,
    so `finish` runs the buckets' all-reduces only; a parameter without a gradient still keeps
    None. Without either condition the flags' all-reduce still runs."""
    calls = _count_all_reduces(monkeypatch)
    for everywhere, same_got, flags in ((True, True, False), (True, False, True), (False, True, True)):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        held = dict(model.named_parameters())
        red = GradReducer(held, [((0,), list(held), group)], {n: i for i, n in enumerate(held)},
                          1 << 20, {id(p): 1 for p in held.values()}, everywhere=everywhere)
        calls.clear()
        red.begin()
        red.arm()
        model[0](torch.randn(2, 4)).sum().backward()
        red.finish(sync=True, same_got=same_got)
        assert model[0].weight.grad is not None and model[1].weight.grad is None
        # one bucket (the four parameters' 40 numbers), then the flags: [overflow, 4 names got a
        # gradient, 4 names got a sparse one]
        assert calls == ([40, 9] if flags else [40]), (everywhere, same_got, calls)


@pytest.mark.parametrize(("own", "used", "sums"), [(2.0, 2.0, 1), (0.0, 1.0, 2), (0.1, 0.1, 1)])
def test_a_loss_gradient_travels_in_the_one_bucket_and_a_differing_one_sums_again(
        group: object, monkeypatch: pytest.MonkeyPatch, own: float, used: float, sums: int) -> None:
    """One bucket over every rank carries the backward's loss gradient after the gradients
    (`LossSeed`): the ranks meet once. Where the ranks' loss gradients differ from the one the
    backward ran from (here: this rank passed 0 and ran from 1), the gradients are scaled by
    mean / used and the bucket is summed again; otherwise they are the plain backward's, exactly."""
    calls = _count_all_reduces(monkeypatch)
    model = _mlp(depth=3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    (ref(x).square().sum() * own).backward()
    held = dict(model.named_parameters())
    red = GradReducer(held, [((0,), list(held), group)], {n: i for i, n in enumerate(held)},
                      1 << 20, {id(p): 1 for p in held.values()}, everywhere=True)
    assert red.carries_seed
    red.begin(seed=LossSeed(torch.tensor(own, dtype=torch.float64),
                            torch.tensor(used, dtype=torch.float64)))
    red.arm()
    (model(x).square().sum() * used).backward()
    red.finish(sync=True, same_got=True)
    total = sum(p.numel() for p in model.parameters())
    assert calls == [total + 8] + [total] * (sums - 1)  # (8 slots: the one rank's seed)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


@pytest.mark.layer("pure")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_loss_gradients_read_back_exactly_from_a_summed_bucket_of_any_dtype(dtype: torch.dtype) -> None:
    """Each rank's float64 loss gradient in its own 8 slots of the bucket's dtype, zeros in
    the others': the sum over the ranks gives every rank's value back bit for bit, and the factor
    is None exactly when every rank passed the value the backward ran from."""
    def summed(seeds: list[float]) -> torch.Tensor:
        tails = []
        for i, s in enumerate(seeds):
            t = torch.zeros(8 * len(seeds), dtype=dtype)
            t[8 * i:8 * i + 8] = LossSeed(torch.tensor(s, dtype=torch.float64), torch.ones(())).slots(dtype)
            tails.append(t)
        return torch.stack(tails).sum(0).to(dtype)

    odd = [1 / 3, -2.5e-20, 65536.0]
    one = LossSeed(torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(1 / 3, dtype=torch.float64))
    assert one.factor(summed([1 / 3] * 3)) is None
    f = one.factor(summed(odd))
    assert f is not None and float(f) == (sum(torch.tensor(odd, dtype=torch.float64)) / 3 / (1 / 3)).item()
    assert summed(odd).round().to(torch.uint8).view(torch.float64).tolist() == odd
    zero = LossSeed(torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64))
    z = zero.factor(summed([0.0, 0.0]))
    assert z is not None and float(z) == 0.0  # every rank passed 0: the gradients are zero


@pytest.mark.layer("pure")
def test_every_replica_computes_only_when_each_has_rows_in_some_microbatch() -> None:
    from rannc.pipeline.rows import RowLayout

    assert RowLayout([4, 4], 2, [[1.0, 1.0]]).every_replica_computes()
    assert RowLayout([1, 0], 2, [[1.0, 1.0]]).every_replica_computes() is False  # one row, two replicas
    assert RowLayout([2, 1], 3, [[1.0, 1.0]]).every_replica_computes() is False  # 1 row per microbatch
    assert RowLayout([4, 2], 3, [[1.0, 1.0]]).every_replica_computes()
    assert RowLayout([2, 2], 5, [[1.0]]).every_replica_computes()  # empty microbatches aside
    assert RowLayout([2, 0], 1, [[1.0], [2.0, 1.0, 1.0]]).every_replica_computes() is False


@pytest.mark.layer("pure")
def test_bucket_mb_is_validated() -> None:
    assert rannc.Config(bucket_mb=0.5).bucket_mb == 0.5
    assert rannc.Config.resolve(environ={"RANNC_BUCKET_MB": "4"}).bucket_mb == 4.0
    with pytest.raises(ConfigError, match="bucket_mb must be a finite number > 0"):
        rannc.Config(bucket_mb=0)


@pytest.mark.layer("pure")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_not_finite_flags_nan_and_infinities_and_leaves_gradients_as_they_are(
        dtype: torch.dtype) -> None:
    """The overflow check (GradScaler's, multiplying by 1 in place) finds NaN, inf and -inf in
    any gradient, strided or empty, of any float dtype, and every gradient keeps its bits."""
    for bad in (None, math.inf, -math.inf, math.nan):
        grads = [torch.randn(7).to(dtype), torch.randn(3, 4).to(dtype)[:, :2],
                 torch.zeros(0, dtype=dtype), torch.tensor([-0.0], dtype=dtype)]
        if bad is not None:
            grads[1][1, 1] = bad
        before = [g.clone() for g in grads]
        assert not_finite(grads) is (bad is not None)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        for g, b in zip(grads, before, strict=True):
            assert torch.equal(g.view(bits), b.view(bits))
    assert not not_finite([])


@pytest.mark.parametrize("tied", [1, 2])
def test_a_reduction_of_one_parameter_holds_no_buffer_as_the_memory_model_counts(
        group: object, tied: int) -> None:
    """A stage without replicas reduces only its tied parameters (an embedding shared with the
    head); one of them is reduced in its own `.grad`, so the reduction holds nothing beyond the
    gradients, and the memory model's bucket (`memory.bucket_memory`) is 0 there: it counted a
    buffer the size of the stage's gradients on the first of 4 BERT and GPT-2 stages. Two need
    the buffer, which the model bounds."""
    from rannc.stage_dp.memory import bucket_memory

    model = _mlp(depth=1)  # a weight and a bias
    held = dict(list(model.named_parameters())[:tied])
    red = GradReducer(held, [((0,), list(held), group)], {n: i for i, n in enumerate(held)},
                      1 << 20, {id(p): 1 for p in held.values()})
    red.begin()
    red.arm()
    model(torch.randn(4, 16)).square().sum().backward()
    red.finish(sync=True)
    shared = sum(p.numel() * 4 for p in held.values())
    grads = sum(p.numel() * 4 for p in model.parameters())
    bound = float(bucket_memory(grads, shared, tied, False, 1 << 20))
    assert red.peak_extra_bytes <= bound
    assert (red.peak_extra_bytes, bound) == ((0, 0.0) if tied == 1 else (shared, shared))
