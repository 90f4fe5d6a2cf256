"""Every bad input that involves several ranks, in one launch, each a clear error on every rank.

    mpiexec -n 2 python tests/scripts/bad_input_check.py TMPDIR

Each scenario calls a RaNNCModule wrongly on purpose, catches the error on every rank and
prints "CASE <name> rank <r> <ErrorType>: <message>" (or "CASE <name> rank <r> NO ERROR"). A
rank that raised while another waited would hang the launch instead (the test's timeout
reports it). The scenarios on the model `main` come before and after its deployment; after
them `main` still trains: its loss and held gradients match the unwrapped model on the global
batch (fp32, rtol 1e-5), printed as "USABLE <when> rank <r> ok". TMPDIR holds the plan files.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import rannc
from rannc import dist as rdist

RTOL, ATOL = 1e-5, 1e-6
WIDTH = 8


class Net(nn.Module):
    """A loss-returning MLP with an optional keyword input."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        if mask is not None:
            y = y * mask
        return y.pow(2).mean()


def say(line: str) -> None:
    """One write per line: two ranks' lines never interleave (writes under 4 KB to a pipe are
    atomic; print() may write the text and the newline separately)."""
    os.write(1, (line + "\n").encode())


def case(name: str, rank: int, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except rannc.RaNNCError as e:
        text = " ".join(str(e).split())
        say(f"CASE {name} rank {rank} {type(e).__name__}: {text}")
        return
    say(f"CASE {name} rank {rank} NO ERROR")


def no_grad_on_rank_1(model: nn.Module, x: torch.Tensor, rank: int) -> Any:
    with torch.no_grad() if rank == 1 else contextlib.nullcontext():
        return model(x)


def local_rows(rank: int) -> tuple[int, int]:
    """Rank 0 has 3 rows, rank 1 has 5: local batch sizes may differ, nothing else may."""
    return (0, 3) if rank == 0 else (3, 8)


def check_step(name: str, model: rannc.RaNNCModule, ref: nn.Module, rank: int, seed: int) -> None:
    """One training step of `model` on this rank's rows equals `ref` on the global batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, WIDTH, generator=g)
    lo, hi = local_rows(rank)
    loss = model(x[lo:hi])
    loss.backward()
    ref.zero_grad()
    ref_loss = ref(x)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    held = 0
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=RTOL, atol=ATOL)
        held += 1
    assert held > 0
    model.zero_grad()
    say(f"USABLE {name} rank {rank} ok ({held} parameters checked)")


def save_plan(path: str, model: nn.Module, n: int, rank: int) -> None:
    """Plan `model` for n CPU-like devices (pure: no process group) and save it on rank 0."""
    if rank == 0:
        cluster = rannc.Cluster.homogeneous(device="V100-32GB", n=n, per_node=n)
        p = rannc.plan(model, (torch.randn(8, WIDTH),), cluster=cluster,
                       config=rannc.Config(profiler="estimate", partition_num=2))
        p.save(path)
    rannc.barrier()


class RankDependent(Net):
    """A forward that depends on the rank: each rank captures another graph."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x, mask)
        return y * 2 if rannc.get_rank() == 1 else y


class OrderByRank(nn.Module):
    """The same operations, traced in an order that differs by rank, as a model iterating a set
    of strings traces them in an order that differs by process (hash randomisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = ["a", "b"] if rannc.get_rank() == 0 else ["b", "a"]
        parts = [torch.tanh(getattr(self, name)(x)) for name in names]
        return (parts[0] * parts[1]).sum()


class Bags(nn.Module):
    """nn.EmbeddingBag over 1-D ids with offsets (a recommender's input), or over 2-D ids
    padded with its padding_idx (`two_d`): the same bags, the same weights."""

    PAD = 49

    def __init__(self, two_d: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="mean", padding_idx=self.PAD if two_d else None)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None,
                labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.bag(ids, offsets)), labels)


def bags(rank: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The global batch's bags (8 of 1 to 5 ids, below Bags.PAD) and labels, and this
    rank's rows (`local_rows`)."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 6, (8,), generator=g)
    rows = [torch.randint(0, Bags.PAD, (int(k),), generator=g) for k in lens]
    return rows, torch.randint(0, 3, (8,), generator=g), torch.tensor(local_rows(rank))


def flat(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D ids and offsets of `rows`."""
    lens = torch.tensor([len(r) for r in rows])
    return torch.cat(rows), torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])


def bags_with_offsets(rank: int) -> None:
    """Each rank passes its own bags as 1-D ids with offsets (what it would pass to DDP):
    rannc takes the ids' length for the batch, and the offsets and labels for inputs shared by
    every rank. Every rank raises, naming them and the 2-D rewrite."""
    rows, labels, (lo, hi) = bags(rank)
    ids, offsets = flat(rows[lo:hi])
    rannc.RaNNCModule(Bags(), profiler="estimate")(ids, offsets, labels[lo:hi])


def bags_of_one_size(rank: int) -> None:
    """As `bags_with_offsets`, 4 bags on each rank: the offsets' and labels' shapes agree,
    their values differ."""
    rows, labels, _ = bags(rank)
    lo, hi = 4 * rank, 4 * rank + 4
    ids, offsets = flat(rows[lo:hi])
    rannc.RaNNCModule(Bags(), profiler="estimate")(ids, offsets, labels[lo:hi])


def bags_padded(rank: int) -> None:
    """The rewrite the error gives: 2-D ids padded with padding_idx, on 2 stages, equal to
    the unwrapped 1-D model on the global batch (loss and gradients)."""
    torch.manual_seed(5)
    model = Bags(two_d=True)
    ref = Bags()
    ref.load_state_dict(model.state_dict())
    rows, labels, (lo, hi) = bags(rank)
    padded = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=Bags.PAD)
    wrapped = rannc.RaNNCModule(model, partition_num=2, profiler="estimate")
    loss = wrapped(padded[lo:hi], None, labels[lo:hi])
    loss.backward()
    ids, offsets = flat(rows)
    ref_loss = ref(ids, offsets, labels)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    want = dict(ref.named_parameters())
    held = [n for n, p in wrapped.named_parameters() if p.numel()]
    for n, p in wrapped.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, want[n].grad, rtol=RTOL, atol=ATOL)
    say(f"USABLE bags_padded rank {rank} ok ({len(held)} parameters checked)")


def bags_split_forced(rank: int) -> None:
    """The same bags on every rank (so the offsets agree): 2 stages forced, where every cut
    would send the bags' embeddings, which have no batch dimension."""
    rows, labels, _ = bags(0)
    ids, offsets = flat(rows[:4])
    rannc.RaNNCModule(Bags(), partition_num=2, profiler="estimate")(ids, offsets, labels[:4])


class ReturnsInputs(Net):
    """Returns its inputs as they are beside the loss, as models do for metrics."""

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": super().forward(x) + labels.float().mean(), "x": x, "labels": labels}


def inputs_returned(rank: int) -> None:
    """On 2 stages and 2 microbatches each rank gets its own rows of the returned inputs,
    and the loss and gradients are the unwrapped model's (before: "model output x is not
    computed by any stage (it is a input)" at the first call)."""
    torch.manual_seed(6)
    model = ReturnsInputs()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, partition_num=2, microbatches=2, profiler="estimate")
    g = torch.Generator().manual_seed(6)
    x, labels = torch.randn(8, WIDTH, generator=g), torch.randint(0, 5, (8,), generator=g)
    lo, hi = local_rows(rank)
    out = wrapped(x[lo:hi], labels[lo:hi])
    want = ref(x, labels)
    assert torch.equal(out["x"], x[lo:hi]) and torch.equal(out["labels"], labels[lo:hi]), out
    out["loss"].backward()
    want["loss"].backward()
    torch.testing.assert_close(out["loss"].detach(), want["loss"].detach(), rtol=RTOL, atol=ATOL)
    grads = dict(ref.named_parameters())
    for n, p in wrapped.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=RTOL, atol=ATOL)
    say(f"USABLE inputs_returned rank {rank} ok ({len(list(wrapped.parameters()))} parameters checked)")


class ReturnsSizes(Net):
    """Returns the batch's sizes beside the loss, or a count made a Python int (`counted`)."""

    def __init__(self, counted: bool = False) -> None:
        super().__init__()
        self.counted = counted

    def forward(self, x: torch.Tensor) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = {"loss": super().forward(x), "n": x.size(0), "shape": x.shape}
        if self.counted:
            out["positive"] = (x > 0).sum().item()
        return out


def sizes_returned(rank: int) -> None:
    """Sizes the model returns are their values on the global batch, as the unwrapped model's
    (before: "'int' object has no attribute 'detach'" at the first call)."""
    wrapped = rannc.RaNNCModule(ReturnsSizes(), partition_num=2, microbatches=2, profiler="estimate")
    lo, hi = local_rows(rank)
    out = wrapped(torch.randn(8, WIDTH)[lo:hi])
    assert out["n"] == 8 and tuple(out["shape"]) == (8, WIDTH), out
    say(f"USABLE sizes_returned rank {rank} ok (n {out['n']}, shape {tuple(out['shape'])})")


def backward_twice(model: nn.Module, n: int) -> None:
    loss = model(torch.randn(n, WIDTH))
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)


def replaced_parameter(model: rannc.RaNNCModule, n: int) -> None:
    """Assign a new tensor to a deployed parameter (on every rank) and call: the error; the
    deployed one is put back (whatever was raised), so the model trains on."""
    net = model.module
    deployed = net.b.weight
    net.b.weight = nn.Parameter(torch.zeros_like(deployed))
    try:
        model(torch.randn(n, WIDTH))
    finally:
        net.b.weight = deployed


class Scaled(Net):
    """A plain Python attribute read in forward (a constant of the captured graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, mask) * self.scale


def attribute_set_on_rank_0(rank: int, n: int) -> None:
    """A step, then rank 0 alone changes an attribute the capture read: every rank raises
    (rank 0 would capture again, the others run the graph they have)."""
    model = rannc.RaNNCModule(Scaled(), partition_num=2, profiler="estimate")
    model(torch.randn(n, WIDTH)).backward()
    if rank == 0:
        model.module.scale = 0.5
    model(torch.randn(n, WIDTH))


class FeatureMean(nn.Module):
    """Returns a statistic per feature over the batch (no rows, not a scalar) beside a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h.mean(0), h.pow(2).mean()


def generate_after_deployment(n: int) -> None:
    """transformers' generate() on 2 stages: refused by name on every rank (it ran the model's own
    forward over the parameters this rank released)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = rannc.RaNNCModule(LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)), partition_num=2, profiler="estimate")
    ids = torch.randint(0, 64, (n, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    model.generate(ids, max_new_tokens=2)


def hook_added_on_rank_0(rank: int, n: int) -> None:
    """A step, then rank 0 alone adds a forward hook: every rank raises (rank 0 would capture
    again, the others run the graph they have)."""
    model = rannc.RaNNCModule(Net(), partition_num=2, profiler="estimate")
    model(torch.randn(n, WIDTH)).backward()
    if rank == 0:
        model.module.a.register_forward_hook(lambda mod, i, o: o * 2)
    model(torch.randn(n, WIDTH))


def dtype_changed_on_rank_0(rank: int, n: int) -> None:
    """A step, then rank 0 alone converts the model to float64: every rank raises (rank 0
    would capture again; before the dtypes were in the capture key, it ran the float32 graph
    on float64 parameters and sent messages of another size)."""
    model = rannc.RaNNCModule(Net(), partition_num=2, profiler="estimate")
    model(torch.randn(n, WIDTH)).backward()
    if rank == 0:
        model.double()
    model(torch.randn(n, WIDTH, dtype=torch.float64 if rank == 0 else torch.float32))


def meta_net() -> nn.Module:
    with torch.device("meta"):
        return Net()


def capture_cache_is_bounded(rank: int, n: int) -> None:
    """A sequence length that changes at every call: at most max_captures runtimes are kept
    (the planned one, even when it is not the oldest entry, and the most recent), with one
    warning saying to pad; what torch kept of the dropped captures (torch.fx's cached sources,
    their ShapeEnvs) goes with them."""
    import gc

    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.graph_module import _loader

    model = rannc.RaNNCModule(Net(), partition_num=2, profiler="estimate", max_captures=2)
    sources = []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        # the planned length (1) used again makes it the most recent, not the first, entry
        for length in (1, 2, 1, 3, 4, 5):
            model(torch.randn(n, length, WIDTH)).backward()
            gc.collect()
            gc.collect()  # (a ShapeEnv given back in the first pass is freed in the second)
            sources.append((len(_loader.eval_cache), sum(isinstance(o, ShapeEnv) for o in gc.get_objects())))
    said = [str(w.message) for w in got if "max_captures" in str(w.message)]
    # (rannc's own guard on the deployed model is no hook of the user's to warn about)
    hooks = sum("hooks or pre-hooks" in str(w.message) for w in got)
    kept = any(rt is model._held.runtime for rt in model._runtimes.values())
    # (lengths 3, 4 and 5 each drop a capture as they make one)
    assert sources[3] == sources[4] == sources[5], f"(torch.fx sources, ShapeEnvs) after each call: {sources}"
    say(f"CACHE rank {rank} runtimes {len(model._runtimes)} planned kept {kept} hook warnings "
        f"{hooks} warnings {len(said)} {' '.join(said[0].split()) if said else ''}")


def edited_plan(src: str, dst: str, edit: Callable[[dict[str, Any]], None], rank: int) -> str:
    """A copy of the plan file `src` changed by `edit` (as a hand edit would), on rank 0."""
    if rank == 0:
        with open(src) as f:
            d = json.load(f)
        edit(d)
        with open(dst, "w") as f:
            json.dump(d, f)
    rannc.barrier()
    return dst


def _move_param(d: dict[str, Any]) -> None:
    name = d["stages"][0]["param_names"].pop(0)
    d["stages"][1]["param_names"].append(name)


# name -> how a valid 2-stage plan for 2 ranks is spoiled (each a one-line error, every rank)
PLAN_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "plan_file_bogus_schedule": lambda d: d.update(schedule="bogus"),
    "plan_file_shares_not_summing_to_1": lambda d: d["stages"][0].update(shares=[0.3]),
    "plan_file_recompute_beyond_1": lambda d: d["stages"][1].update(recompute=2.0),
    "plan_file_more_microbatches_than_rows": lambda d: d.update(microbatches=100),
    "plan_file_parameter_moved_between_stages": _move_param,
    "plan_file_rank_in_two_stages": lambda d: d["stages"][1].update(ranks=[0]),
}


def main() -> None:
    tmp = sys.argv[1]
    ctx = rdist.init_process_group(120)
    r = ctx.rank
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    main_model = rannc.RaNNCModule(net, partition_num=2, profiler="estimate")
    n = 3 if r == 0 else 5  # different local batch sizes: allowed

    case("input_shape", r, lambda: main_model(torch.randn(n, WIDTH if r == 0 else WIDTH + 1)))
    case("input_dtype", r, lambda: main_model(
        torch.randn(n, WIDTH, dtype=torch.float32 if r == 0 else torch.float64)))
    case("keyword_arguments", r, lambda: main_model(
        torch.randn(n, WIDTH), **({"mask": torch.ones(n, 4)} if r == 0 else {})))
    case("grad_mode", r, lambda: no_grad_on_rank_1(main_model, torch.randn(n, WIDTH), r))
    case("input_device", r, lambda: main_model(torch.randn(n, WIDTH, device="meta")))
    check_step("after_errors_before_deployment", main_model, ref, r, seed=1)
    # Deployed now: a rank with another signature would capture again and build a new runtime
    # alone, unless the check comes first.
    case("keyword_arguments_after_deployment", r, lambda: main_model(
        torch.randn(n, WIDTH), **({"mask": torch.ones(n, 4)} if r == 1 else {})))
    case("backward_twice_on_a_pipelined_output", r, lambda: backward_twice(main_model, n))
    case("parameter_replaced_after_deployment", r, lambda: replaced_parameter(main_model, n))
    main_model.zero_grad()
    check_step("after_errors_after_deployment", main_model, ref, r, seed=2)
    case("zero_rows_at_the_first_call", r, lambda: rannc.RaNNCModule(
        Net(), partition_num=2, profiler="estimate")(torch.randn(n if r == 0 else 0, WIDTH)))
    case("graph_differs_across_ranks", r, lambda: rannc.RaNNCModule(
        RankDependent(), partition_num=2, profiler="estimate")(torch.randn(n, WIDTH)))
    case("graph_order_differs_across_ranks", r, lambda: rannc.RaNNCModule(
        OrderByRank(), partition_num=2, profiler="estimate")(torch.randn(n, WIDTH)))
    case("attribute_differs_across_ranks", r, lambda: attribute_set_on_rank_0(r, n))
    case("hook_added_on_one_rank", r, lambda: hook_added_on_rank_0(r, n))
    case("dtype_changed_on_one_rank", r, lambda: dtype_changed_on_rank_0(r, n))
    case("generate_after_deployment", r, lambda: generate_after_deployment(n))
    case("output_without_rows", r, lambda: rannc.RaNNCModule(
        FeatureMean(), profiler="estimate")(torch.randn(n, WIDTH)))
    case("meta_model_never_materialised", r, lambda: rannc.RaNNCModule(
        meta_net(), partition_num=2, profiler="estimate")(torch.randn(n, WIDTH)))
    case("per_sample_input_not_batched", r, lambda: bags_with_offsets(r))
    case("whole_inputs_differ_across_ranks", r, lambda: bags_of_one_size(r))
    bags_padded(r)
    inputs_returned(r)
    sizes_returned(r)
    case("int_from_values_returned", r, lambda: rannc.RaNNCModule(
        ReturnsSizes(counted=True), partition_num=2, profiler="estimate")(torch.randn(n, WIDTH)))
    case("forced_stages_cannot_be_cut", r, lambda: bags_split_forced(r))

    case("replicas_do_not_divide_ranks", r, lambda: rannc.RaNNCModule(
        Net(), replicas=[2, 1], profiler="estimate")(torch.randn(n, WIDTH)))
    case("no_plan_fits_memory", r, lambda: rannc.RaNNCModule(
        Net(), profiler="estimate", mem_limit_gb=1e-6)(torch.randn(n, WIDTH)))

    three = os.path.join(tmp, "plan_for_3_ranks.json")
    save_plan(three, Net(), 3, r)
    case("plan_file_other_world_size", r, lambda: rannc.RaNNCModule(
        Net(), load_deployment=True, deployment_file=three)(torch.randn(n, WIDTH)))
    other = os.path.join(tmp, "plan_of_other_model.json")
    save_plan(other, nn.Sequential(nn.Linear(WIDTH, 32), nn.ReLU(), nn.Linear(32, 1)), 2, r)
    case("plan_file_other_model", r, lambda: rannc.RaNNCModule(
        Net(), load_deployment=True, deployment_file=other)(torch.randn(n, WIDTH)))
    bad = os.path.join(tmp, "plan_not_json.json")
    if r == 0:
        with open(bad, "w") as f:
            f.write("{not json")
    rannc.barrier()
    case("plan_file_unreadable", r, lambda: rannc.RaNNCModule(
        Net(), load_deployment=True, deployment_file=bad if r == 0 else bad + ".absent")(
            torch.randn(n, WIDTH)))
    # Only rank 0 reads the plan file: here rank 1's path holds a stale plan (for 3 ranks), as
    # an older copy on another node's disk would; it is never read.
    two = os.path.join(tmp, "plan_for_2_ranks.json")
    save_plan(two, Net(), 2, r)
    for name, edit in PLAN_EDITS.items():
        path = edited_plan(two, os.path.join(tmp, name + ".json"), edit, r)
        case(name, r, lambda path=path: rannc.RaNNCModule(  # type: ignore[misc]
            Net(), load_deployment=True, deployment_file=path)(torch.randn(n, WIDTH)))
    torch.manual_seed(4)
    net2 = Net()
    ref2 = copy.deepcopy(net2)
    loaded = rannc.RaNNCModule(net2, load_deployment=True, deployment_file=two if r == 0 else three)
    check_step("plan_file_read_on_rank_0_only", loaded, ref2, r, seed=4)
    say(f"LOADED rank {r} stages {len(loaded.plan.stages)}")
    check_step("at_the_end", main_model, ref, r, seed=3)
    capture_cache_is_bounded(r, n)
    say(f"DONE rank {r}")


if __name__ == "__main__":
    main()
