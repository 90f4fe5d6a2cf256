"""One multi-rank exactness run: the wrapped model against the unwrapped one on the global batch.

    mpiexec -n 3 python tests/scripts/pipeline_check.py --model bert --replicas 2,1 --microbatches 2

Every rank builds the same model and global batch (same seed), feeds its own rows
to the wrapped model and the whole batch to a copy of the original, and compares
its output rows, the loss, the gradients of the parameters it holds and, after
3 AdamW steps, those parameters (fp32, rtol 1e-5). Prints "PASS rank R" or raises.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
import case_batch  # noqa: E402
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402

RANNC_LOG_LEVEL = logging.INFO  # the plan table and the schedule choices, which the tests read
# (atol 2e-6: after two AdamW steps one output element of 1280 differed by 1.34e-6 on an AMD
# EPYC host, 1F1B over 4 microbatches, where the gradients' summation order differs)
FP32_TOL = (1e-5, 2e-6)
BF16_TOL = (2e-2, 2e-2)
RTOL, ATOL = FP32_TOL


def local_sizes(n: int, world: int) -> list[int]:
    """Uneven on purpose when n does not divide: the first ranks get one more row."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def rows_of(x: Any, rows: tuple[int, int], n: int) -> Any:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    k = x.shape[0] // n
    return x[rows[0] * k: rows[1] * k]


def user_loss(name: str, out: Any, y: torch.Tensor | None) -> torch.Tensor:
    """The per-rank loss a training script would compute from the model's output."""
    if name in ("bert", "gpt2", "t5", "llama"):
        return out.loss
    if name == "resnet":
        return F.cross_entropy(out, y)
    if name in ("fork_join", "writes"):
        return (out ** 2).mean()
    if name == "shared_param":
        return out.pow(2).sum()
    return out["loss"] + out["out"].mean()


def compare_and_loss(name: str, out: Any, ref_out: Any, y: torch.Tensor, sizes: list[int],
                     rank: int, what: str,
                     loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check this rank's output rows against the reference's; return (this rank's loss, the
    reference loss whose gradient DDP semantics give). `loss_fn(out, y)` replaces the model
    set's `user_loss(name, ...)` (random models)."""
    if loss_fn is None:
        loss_fn = lambda o, yy: user_loss(name, o, yy)  # noqa: E731
    n = sum(sizes)
    ranges = [(sum(sizes[:q]), sum(sizes[:q + 1])) for q in range(len(sizes))]
    mine = ranges[rank]
    for x, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref_out), strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, rows_of(r, mine, n), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {what} output: {m}")
    loss = loss_fn(out, y[mine[0]:mine[1]])
    if name in ("bert", "gpt2", "t5"):
        return loss, ref_out.loss
    ref_loss = sum(loss_fn(pytree.tree_map(lambda t, rr=rr: rows_of(t, rr, n), ref_out),
                           y[rr[0]:rr[1]]) for rr in ranges) / len(sizes)
    return loss, ref_loss


def _bf16(x: Any) -> Any:
    return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def autocast(a: argparse.Namespace) -> Any:
    if not a.autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[a.autocast])


def cut_seq(x: Any, seq: int) -> Any:
    """Token tensors (integer, batch x sequence) cut to the first `seq` positions."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
        return x[:, :seq].contiguous()
    return x


def other_calls(a: argparse.Namespace, name: str, model: Any, ref: Any, rank: int,
                world: int) -> None:
    """On the deployed model: eval mode under no_grad, alternated with training calls; a
    smaller last batch; a new sequence length. Outputs and gradients against the reference."""
    ref_names = dict(ref.named_parameters())
    calls = []
    if a.eval_check:
        calls.append(("eval", a.batch, 0))
    if a.last_batch:
        calls.append(("last batch", a.last_batch, 0))
    if a.new_seq:
        calls.append(("new sequence", a.batch, a.new_seq))
    for what, n, seq in calls * 2:  # twice: the second time reuses what the first deployed
        case = make_case(name, batch=n, seed=5)
        args, kwargs = list(case.args), dict(case.kwargs)
        if seq:
            args = [cut_seq(x, seq) for x in args]
            kwargs = {k: cut_seq(v, seq) for k, v in kwargs.items()}
        sizes = local_sizes(n, world)
        lo = sum(sizes[:rank])
        mine = (lo, lo + sizes[rank])
        l_args = [rows_of(x, mine, n) for x in args]
        l_kwargs = {k: rows_of(v, mine, n) for k, v in kwargs.items()}
        y = torch.randint(0, 5, (n,))
        if what == "eval":
            model.eval()
            ref.eval()
            with torch.no_grad():
                compare_and_loss(name, model(*l_args, **l_kwargs), ref(*args, **kwargs), y, sizes,
                                 rank, what)
            model.train()
            ref.train()
        else:
            model.zero_grad()
            ref.zero_grad()
            loss, ref_loss = compare_and_loss(name, model(*l_args, **l_kwargs), ref(*args, **kwargs),
                                              y, sizes, rank, what)
            loss.backward()
            ref_loss.backward()
            for pn, p_ in model.named_parameters():
                torch.testing.assert_close(p_.grad, ref_names[pn].grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, pn=pn, w=what: f"rank {rank} {w} grad {pn}: {m}")
        print(f"OK {what} {name} rank {rank}", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a model name, or several separated by commas")
    p.add_argument("--replicas", default="")
    p.add_argument("--partition-num", type=int, default=0)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--rows", default="", help="each rank's rows at the first call, e.g. 4,4,1,4 "
                   "(default: as even as the batch allows)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpointing", default="auto")
    p.add_argument("--schedule", default="auto")
    p.add_argument("--recompute-fraction", type=float, default=None,
                   help="force this fraction of each stage's components to be recomputed")
    p.add_argument("--selective", action="store_true",
                   help="force selective recomputation on every stage")
    p.add_argument("--cluster-file", default="", help="a JSON cluster description (mixed devices)")
    p.add_argument("--shares", default="", help="row shares per stage, e.g. '3,1;1'")
    p.add_argument("--loss-scale", type=float, default=1.0, help="backward of loss * this")
    p.add_argument("--grad-scaler", action="store_true", help="torch.amp.GradScaler on both")
    p.add_argument("--untie", action="store_true",
                   help="the Hugging Face models' output embedding a parameter of its own (no "
                        "parameter held by two stages)")
    p.add_argument("--scaler-init", type=float, default=2.0 ** 10,
                   help="the GradScalers' initial scale (1: the loss gradient is exactly 1 until "
                        "the first overflow halves it)")
    p.add_argument("--trace", default="", help="record events and write the trace files here")
    p.add_argument("--eval-check", action="store_true", help="an eval call after training")
    p.add_argument("--eval-every", type=int, default=0,
                   help="after every this many training steps, an eval call under no_grad")
    p.add_argument("--inject-overflow", type=int, default=-1,
                   help="at this step, an inf gradient on the first rank's first parameter "
                        "(and the reference's); with --grad-scaler every rank must skip the step")
    p.add_argument("--autocast", default="", help="bf16 or fp16: both models run under autocast")
    p.add_argument("--bf16", action="store_true", help="both models cast to bfloat16")
    p.add_argument("--last-batch", type=int, default=0, help="a call with this global batch")
    p.add_argument("--new-seq", type=int, default=0, help="a call with this sequence length")
    p.add_argument("--extra-forward", action="store_true",
                   help="before each step, a forward under grad mode whose backward never comes")
    p.add_argument("--mem-limit-gb", type=float, default=None)
    p.add_argument("--expect-error", default="", help="the first call must raise with this text")
    return p.parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    global RTOL, ATOL
    RTOL, ATOL = FP32_TOL  # set for each case: one launch may run an fp32 case after a bf16 one
    if a.autocast or a.bf16:  # the pipeline sums microbatches in another order: bf16 agreement
        RTOL, ATOL = BF16_TOL
    for name in a.model.split(","):
        check_model(a, name, ctx)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rannc").setLevel(RANNC_LOG_LEVEL)
    case_batch.main(parse, run)


def check_model(a: argparse.Namespace, name: str, ctx: rdist.DistContext) -> None:
    rank, world = ctx.rank, ctx.world_size
    case = make_case(name, batch=a.batch, seed=0)
    if a.untie and hasattr(case.model, "get_output_embeddings"):
        head = case.model.get_output_embeddings()
        case.model.config.tie_word_embeddings = False
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    torch.manual_seed(1)
    y = torch.randint(0, 5, (a.batch,))
    sizes = [int(r) for r in a.rows.split(",")] if a.rows else local_sizes(a.batch, world)
    if len(sizes) != world or sum(sizes) != a.batch:
        raise SystemExit(f"--rows {a.rows} must give {world} ranks {a.batch} rows in all")
    lo = sum(sizes[:rank])
    mine = (lo, lo + sizes[rank])
    if a.bf16:
        case.model.to(torch.bfloat16)
        case = dataclasses.replace(case, args=tuple(_bf16(x) for x in case.args),
                                   kwargs={k: _bf16(v) for k, v in case.kwargs.items()})
    ref = copy.deepcopy(case.model)
    opts: dict[str, Any] = {"microbatches": a.microbatches or None, "checkpointing": a.checkpointing,
                            "schedule": a.schedule,
                            "mem_limit_gb": a.mem_limit_gb}
    if a.trace:
        opts["trace"] = True
    if a.cluster_file:
        opts["cluster_file"] = a.cluster_file
    extra: dict[str, Any] = {}
    if a.recompute_fraction is not None:
        extra["recompute_fraction"] = a.recompute_fraction
    if a.selective:
        extra["selective"] = True
    if a.shares:
        extra["shares"] = [[float(x) for x in st.split(",")] for st in a.shares.split(";")]
    if extra:
        opts["extra"] = extra
    if a.replicas:
        opts["replicas"] = [int(x) for x in a.replicas.split(",")]
    if a.partition_num:
        opts["partition_num"] = a.partition_num
    # eps 1e-4: some gradients are zero up to float noise (BERT's attention key biases);
    # with a tiny eps Adam would turn that noise into full-size steps in either run.
    opt_w = torch.optim.AdamW(case.model.parameters(), lr=1e-2, eps=1e-4)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    model = rannc.RaNNCModule(case.model, opt_w, **opts)
    scaler_w = torch.amp.GradScaler("cpu", init_scale=a.scaler_init)
    scaler_r = torch.amp.GradScaler("cpu", init_scale=a.scaler_init)
    l_args = [rows_of(x, mine, a.batch) for x in case.args]
    l_kwargs = {k: rows_of(v, mine, a.batch) for k, v in case.kwargs.items()}
    ref_names = dict(ref.named_parameters())
    if a.expect_error:
        try:
            model(*l_args, **l_kwargs)
        except rannc.RaNNCError as e:
            assert a.expect_error in str(e), str(e)
            print(f"PASS rank {rank} error: {e}", flush=True)
            return
        raise AssertionError("the call did not raise")
    hooks: list[Any] = []
    for step in range(a.steps):
        for h in hooks:
            h.remove()
        hooks = []
        if step == a.inject_overflow:
            firsts: list[Any] = [None] * world  # on the first rank holding a parameter
            torch.distributed.all_gather_object(firsts, next(iter(dict(model.named_parameters())), None))
            src = next(r for r, x in enumerate(firsts) if x is not None)
            inf = lambda g: g * float("inf")  # noqa: E731
            hooks.append(ref_names[firsts[src]].register_hook(inf))
            # (on every rank, as the model's code would: rannc runs a parameter's hooks once,
            # on the gradient summed over its holders)
            hooks.append(dict(model.module.named_parameters())[firsts[src]].register_hook(inf))
        if a.extra_forward:  # evaluation under grad mode: nothing may be committed
            model(*l_args, **l_kwargs)
        with autocast(a):
            out = model(*l_args, **l_kwargs)
            ref_out = ref(*case.args, **case.kwargs)
        loss, ref_loss = compare_and_loss(name, out, ref_out, y, sizes, rank, f"step {step}")
        if a.grad_scaler:
            scaler_w.scale(loss).backward()
            scaler_r.scale(ref_loss).backward()
        else:
            (loss * a.loss_scale).backward()
            (ref_loss * a.loss_scale).backward()
        if a.grad_scaler:  # compare true gradients: the scale would magnify float noise
            scaler_w.unscale_(opt_w)
            scaler_r.unscale_(opt_r)
        held = dict(model.named_parameters())
        if step == a.inject_overflow:  # every rank must see the overflow, whoever had it
            assert not all(torch.isfinite(p_.grad).all() for p_ in held.values() if p_.grad is not None) \
                or not held, f"rank {rank} did not see the overflow"
            held = {}
        for n, p_ in held.items():
            g = ref_names[n].grad
            torch.testing.assert_close(p_.grad, g, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n, step=step: f"rank {rank} step {step} grad {n}: {m}")
        if a.grad_scaler:
            for sc, o in ((scaler_w, opt_w), (scaler_r, opt_r)):
                sc.step(o)
                sc.update()
            assert scaler_w.get_scale() == scaler_r.get_scale(), (rank, step, scaler_w.get_scale())
        else:
            opt_w.step()
            opt_r.step()
        opt_w.zero_grad()
        opt_r.zero_grad()
        if a.eval_every and (step + 1) % a.eval_every == 0:
            model.eval()
            ref.eval()
            with torch.no_grad():
                compare_and_loss(name, model(*l_args, **l_kwargs), ref(*case.args, **case.kwargs),
                                 y, sizes, rank, f"eval after step {step}")
            model.train()
            ref.train()
            print(f"OK alternation {name} rank {rank} step {step}", flush=True)
    for n, p_ in model.named_parameters():
        torch.testing.assert_close(p_, ref_names[n], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=n: f"rank {rank} param {n}: {m}")
    other_calls(a, name, model, ref, rank, world)
    # Optimizer state: under ZeRO-1 each parameter's on one of its holders only.
    own = {id(p_) for p_ in case.model.parameters()}  # (not rannc's stand-in on a rank holding none)
    print(f"STATE {name} rank {rank} params_with_state {sum(id(p_) in own for p_ in opt_w.state)} "
          f"of_reference {len(opt_r.state)} zero {model.plan.zero_stage if model.plan else 0}",
          flush=True)
    rts = list(model._runtimes.values())
    print(f"GUESSES {name} rank {rank} guessed {sum(r.guessed_calls for r in rts)} "
          f"rerun {sum(r.rerun_calls for r in rts)}", flush=True)
    recorders = [part.recorder for r in rts for parts in r.parts.values() for part in parts
                 if part is not None and part.recorder is not None]
    print(f"SELECTIVE {name} rank {rank} parts {len(recorders)} "
          f"dropped {sum(x.dropped for x in recorders)}", flush=True)
    if a.trace:
        files = model.write_trace(f"{a.trace}_{name}")
        if rank == 0:
            print(f"TRACE {' '.join(files)}", flush=True)
    # What this rank really stores: the released parameters have no elements left.
    n_held = sum(p_.numel() for p_ in case.model.parameters())
    stage = model.plan.stage_of_rank(rank).index if model.plan else 0
    print(f"PASS {name} rank {rank} of {world} stage {stage} params {n_held}", flush=True)
    if rank == 0 and model.plan is not None:
        print(f"STAGES {len(model.plan.stages)} SCHEDULE {model.plan.schedule}", flush=True)
        print(model.plan.summary(), flush=True)


if __name__ == "__main__":
    main()
