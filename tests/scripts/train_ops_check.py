"""What a training loop does besides forward and backward, on several ranks, against the
unwrapped model on the global batch: freezing and unfreezing parameters between steps, calls
between a forward and its backward, gradient
clipping by the global norm, gradient accumulation under no_sync() (also over input shapes),
and torch optimizers with LR schedulers.

    mpiexec -n 4 python tests/scripts/train_ops_check.py --model bert --partition-num 4 --microbatches 2

Every rank builds the same model and data (same seed) and mirrors every operation on a copy of
the original model fed the whole global batch; it compares the clipped norm, the gradients and
the parameters it holds (fp32, rtol 1e-5). One wrapped model per model name runs every check in
turn, so both copies stay equal from one check to the next. Prints "PASS <model> rank R".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
import case_batch  # noqa: E402
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402
from rannc.schedule import get_spec  # noqa: E402

# The conformance suite's fp32 tolerances for atol. Gradients: one summed from many terms of
# both signs takes their rounding; after the freezing steps, BERT's position embedding gradient
# at one element (0.06 to 0.2) differed by 2.6e-6 to 3.7e-6 under data parallelism (another
# summation order; the same runs in float64 agree within 1e-10). Parameters after many Adam
# steps: Adam divides each gradient by its own running scale, so the float rounding of a
# near-zero gradient (a rarely used token_type_embeddings row) becomes a step of lr size; after
# 17 steps such an element differed by 1.26e-6. On an AMD EPYC host (another BLAS path, so
# other roundings) BERT's word embedding row 30 after the SGD-with-momentum steps differed by
# 1.055e-5 (2026-12-07), hence 2e-5.
RTOL, ATOL = 1e-5, 2e-5
K = 4  # accumulation micro-steps


class Pair:
    """The wrapped model and the reference, with the data: K global batches of `batch` rows."""

    def __init__(self, name: str, a: argparse.Namespace, rank: int, world: int) -> None:
        self.name, self.rank, self.world, self.batch = name, rank, world, a.batch
        case = make_case(name, batch=K * a.batch, seed=0)
        self.ref = copy.deepcopy(case.model)
        self.case = case
        sizes = [a.batch // world + (1 if r < a.batch % world else 0) for r in range(world)]
        self.mine = (sum(sizes[:rank]), sum(sizes[:rank + 1]))
        # eps 1e-4: some gradients are float noise (BERT's attention key biases); a tiny eps
        # would turn the noise into full-size steps in either run.
        self.opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2, eps=1e-4)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=1e-2, eps=1e-4)
        opts: dict[str, Any] = {"microbatches": a.microbatches, "schedule": a.schedule}
        if a.replicas:
            opts["replicas"] = [int(x) for x in a.replicas.split(",")]
        if a.partition_num:
            opts["partition_num"] = a.partition_num
        self.model = rannc.RaNNCModule(case.model, self.opt, **opts)
        self.ref_params = dict(self.ref.named_parameters())

    def _kwargs(self, k: int, rows: tuple[int, int] | None, cut: int = 0) -> dict[str, Any]:
        lo = k * self.batch
        a, b = (lo, lo + self.batch) if rows is None else (lo + rows[0], lo + rows[1])
        # cut: the last `cut` tokens of each sequence dropped (a batch padded to another length)
        return {n: v[a:b] if v.dim() < 2 or not cut else v[a:b, :-cut].contiguous()
                for n, v in self.case.kwargs.items()}

    def loss(self, k: int, cut: int = 0) -> torch.Tensor:
        """The wrapped model's loss on global batch k (every rank gets the global value)."""
        return self.model(**self._kwargs(k, self.mine, cut)).loss

    def ref_loss(self, k: int | None, cut: int = 0) -> torch.Tensor:
        """The reference's loss on global batch k, or on all K of them (k None)."""
        kw = self.case.kwargs if k is None else self._kwargs(k, None, cut)
        return self.ref(**kw).loss

    def zero_grad(self) -> None:
        self.model.zero_grad()
        self.ref.zero_grad()

    def check_grads(self, what: str) -> None:
        for n, p in self.model.named_parameters():
            torch.testing.assert_close(p.grad, self.ref_params[n].grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"{self.tag} {what} grad {n}: {m}")

    def check_params(self, what: str) -> None:
        for n, p in self.model.named_parameters():
            torch.testing.assert_close(p, self.ref_params[n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"{self.tag} {what} param {n}: {m}")

    def refused(self, run: Callable[[], Any], says: str, what: str) -> None:
        """`run` raises a RaNNCError saying `says` (on this rank)."""
        try:
            run()
        except rannc.RaNNCError as e:
            assert says in str(e), str(e)
        else:
            raise AssertionError(f"{self.tag}: {what} did not raise")

    @property
    def tag(self) -> str:
        return f"{self.name} rank {self.rank}"


def check_clip(pr: Pair) -> None:
    """The 2-norm and the inf-norm, through model.clip_grad_norm_ and through
    torch.nn.utils.clip_grad_norm_(model.parameters()), with a max_norm that clips."""
    apis: list[tuple[str, Callable[[float, float], torch.Tensor]]] = [
        ("model.clip_grad_norm_", lambda c, p: pr.model.clip_grad_norm_(c, p)),
        ("torch.nn.utils.clip_grad_norm_",
         lambda c, p: torch.nn.utils.clip_grad_norm_(pr.model.parameters(), c, norm_type=p)),
    ]
    for norm_type in (2.0, math.inf):
        for api, clip in apis:
            pr.zero_grad()
            pr.loss(0).backward()
            pr.ref_loss(0).backward()
            full = torch.nn.utils.get_total_norm([p.grad for p in pr.ref.parameters()], norm_type)
            max_norm = float(full) / 3
            want = torch.nn.utils.clip_grad_norm_(pr.ref.parameters(), max_norm, norm_type)
            got = clip(max_norm, norm_type)
            what = f"{api} norm_type {norm_type}"
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, what=what: f"{pr.tag} {what} norm: {m}")
            pr.check_grads(f"{what} clipped")
    # Only some of the parameters: a norm over them would be local, so it is refused.
    some = list(pr.model.parameters())[:1]
    pr.refused(lambda: torch.nn.utils.clip_grad_norm_(some, 1.0), "model.clip_grad_norm_",
               "clipping a subset of the parameters")
    pr.zero_grad()


def _live_bytes() -> int:
    """Bytes of the distinct CPU storages of every live tensor of this process."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() touches deprecated torch.distributed aliases
        warnings.simplefilter("ignore")
        for t in gc.get_objects():
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    s = t.untyped_storage()
                    if s.nbytes():
                        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def check_accumulation(pr: Pair) -> None:
    """K calls, the first K-1 under no_sync(), each backward of loss / K, equal one call on the
    K-times larger batch; then clip and an AdamW step. Between the calls the rank keeps one
    gradient per parameter, as DDP's accumulation: what it holds after the first no_sync()
    backward does not grow with the later ones (it used to keep the local sums a second time,
    beside `.grad`), nor with the loss a loop keeps until its next forward (which kept the
    gradients of an eager schedule's line a second time where `.grad` got other tensors)."""
    pr.zero_grad()
    live, kept = [], []
    for k in range(K):
        ctx = pr.model.no_sync() if k < K - 1 else contextlib.nullcontext()
        with ctx:
            loss = pr.loss(k) / K
            loss.backward()
        held = _live_bytes()
        del loss
        live.append(_live_bytes())
        kept.append(held - live[-1])
        if k == 0:
            pr.refused(lambda: pr.model.clip_grad_norm_(1.0), "no_sync",
                       "clip_grad_norm_ under no_sync")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in pr.model.parameters()
                if p.grad is not None)
    # (slack: small per-call state, e.g. a routing table or a loss scalar)
    assert max(live[:-1]) - live[0] < 0.05 * grads, (f"{pr.tag}: live tensor bytes after each "
                                                     f"no_sync() backward {live[:-1]}, "
                                                     f"gradients {grads}")
    assert max(kept) < 0.05 * grads, (f"{pr.tag}: bytes the loss kept alive after each "
                                      f"backward {kept}, gradients {grads}")
    pr.ref_loss(None).backward()
    pr.check_grads("accumulated")
    got = pr.model.clip_grad_norm_(0.5)
    want = torch.nn.utils.clip_grad_norm_(pr.ref.parameters(), 0.5)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    pr.opt.step()
    pr.ref_opt.step()
    pr.zero_grad()
    pr.check_params("accumulated step")


def check_accumulation_reshaped(pr: Pair) -> None:
    """Dynamic padding under accumulation: the K micro-steps alternate between two sequence
    lengths, so they run two graphs (the second captured again and placed on the deployed
    stages), and the last, synchronised backward, on the second graph, sums what both left in
    `.grad` (before the fix, each signature's runtime kept its own no_sync() sums: the tied and
    replicated parameters' gradients were wrong)."""
    pr.zero_grad()
    for k in range(K):
        ctx = pr.model.no_sync() if k < K - 1 else contextlib.nullcontext()
        with ctx:
            (pr.loss(k, cut=k % 2) / K).backward()
        (pr.ref_loss(k, cut=k % 2) / K).backward()
    pr.check_grads("accumulated over sequence lengths")
    pr.opt.step()
    pr.ref_opt.step()
    pr.zero_grad()
    pr.check_params("accumulated over sequence lengths, step")


def _embedding(model: nn.Module) -> nn.Module:
    """The token embedding (BERT's embeddings block, GPT-2's wte and wpe)."""
    inner = getattr(model, "module", model)
    return inner.bert.embeddings if hasattr(inner, "bert") else inner.transformer.wte


def check_freeze_unfreeze(pr: Pair) -> None:
    """Fine-tuning's freezing: the embedding frozen (requires_grad False) for a step, trained
    the next, frozen again, set on both models between calls (run first: the model is
    deployed with it frozen)."""
    for frozen in (True, False, True):
        for m in (pr.model, pr.ref):
            _embedding(m).requires_grad_(not frozen)
        pr.zero_grad()
        pr.loss(0).backward()
        pr.ref_loss(0).backward()
        pr.check_grads(f"embedding frozen {frozen}")
        pr.opt.step()
        pr.ref_opt.step()
        pr.check_params(f"embedding frozen {frozen}, step")
    for m in (pr.model, pr.ref):
        _embedding(m).requires_grad_(True)
    pr.zero_grad()


def check_abandoned_accumulation(pr: Pair) -> None:
    """An accumulation given up (a non-finite loss, an epoch ending mid-window): backwards
    under no_sync(), then zero_grad() (set to None, then zeroed in place), then a synchronised
    step: its gradients are that step's alone, as DDP reduces whatever `.grad` holds."""
    for set_to_none in (True, False):
        pr.zero_grad()
        for k in range(2):
            with pr.model.no_sync():
                pr.loss(k).backward()
        pr.model.zero_grad(set_to_none=set_to_none)
        pr.ref.zero_grad()
        # nothing is pending any more: clipping is not refused (the norm of zero gradients)
        assert float(pr.model.clip_grad_norm_(1.0)) == 0.0
        pr.loss(2).backward()
        pr.ref_loss(2).backward()
        pr.check_grads(f"after an abandoned accumulation (zero_grad set_to_none={set_to_none})")
    pr.zero_grad()


def check_calls_between(pr: Pair) -> None:
    """Calls between a forward and its backward, as training loops make them: one under
    torch.no_grad() (a metric) leaves the backward to come exact; a call whose loss the loop
    drops (a non-finite loss skipped) does not disturb the next; a backward through an earlier
    call's outputs after another call with gradients is refused on every rank (rannc keeps the
    latest call's pipeline state; before, a call without gradients in between made the backward
    fail with "backward() without a forward()")."""
    pr.zero_grad()
    loss = pr.loss(0)
    with torch.no_grad():
        metric = pr.loss(1)
    torch.testing.assert_close(metric, pr.ref_loss(1).detach(), rtol=RTOL, atol=ATOL)
    loss.backward()
    pr.ref_loss(0).backward()
    pr.check_grads("a call under no_grad between forward and backward")
    pr.zero_grad()
    skipped = pr.loss(0)
    del skipped
    pr.loss(1).backward()
    pr.ref_loss(1).backward()
    pr.check_grads("a call without backward, then one with")
    pr.opt.step()
    pr.ref_opt.step()
    pr.check_params("a call without backward, then one with, step")
    pr.zero_grad()
    first = pr.loss(0)
    pr.loss(1)
    pr.refused(first.backward, "backward() through the outputs of an earlier call",
               "backward through an earlier call's outputs")
    pr.zero_grad()
    # one loss over two calls' outputs (a GAN's D(real) + D(fake)): the later call's backward
    # runs first, then the earlier one's is refused by the same message (it said "without a
    # forward()" before)
    both = pr.loss(0) + pr.loss(1)
    pr.refused(both.backward, "backward() through the outputs of an earlier call",
               "one loss over two calls' outputs")
    pr.zero_grad()


def check_no_sync_around_backward_only(pr: Pair) -> None:
    """Under 1F1B with parameters several ranks hold, their all-reduce starts in forward(), so
    a forward outside no_sync() whose backward runs inside it is refused, on every rank alike
    (as DDP decides at forward); the next calls run as usual."""
    plan = pr.model.plan
    assert plan is not None
    if not get_spec(plan.schedule).eager or all(len(set(r)) < 2 for r in plan.holders().values()):
        return
    pr.zero_grad()
    loss = pr.loss(0)
    with pr.model.no_sync():
        pr.refused(loss.backward, "no_sync() must hold the forward call too",
                   "backward under no_sync after a forward outside it")
    pr.zero_grad()


def check_zero_grad_between_forward_and_backward(pr: Pair) -> None:
    """`loss = model(x); opt.zero_grad(); loss.backward()`: the gradients are this backward's
    alone, though the schedules that run backward inside forward() start summing them there,
    while `.grad` still held the last step's."""
    pr.zero_grad()
    pr.loss(1).backward()  # last step's gradients, in .grad when the next forward runs
    loss = pr.loss(0)
    pr.zero_grad()
    loss.backward()
    pr.ref_loss(0).backward()
    pr.check_grads("zero_grad between forward and backward")
    pr.zero_grad()


Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedFactory = Callable[[torch.optim.Optimizer], Any]

OPTIMIZERS: list[tuple[str, Factory, SchedFactory]] = [
    ("SGD(momentum)+StepLR", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
    ("Adam+LambdaLR", lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),
     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))),
    # A start-up accumulator keeps Adagrad from blowing float noise in tiny gradients up to steps.
    ("Adagrad+CosineAnnealingLR",
     lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)),
]


def check_optimizers(pr: Pair, steps: int) -> None:
    """AdamW (given to RaNNCModule) with OneCycleLR, then optimizers built after deployment from
    model.parameters(), each with a scheduler; clipping at 1.0 before every step, as HF does."""
    runs: list[tuple[str, torch.optim.Optimizer, torch.optim.Optimizer, Any, Any]] = []
    one_cycle = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=steps)  # noqa: E731
    runs.append(("AdamW+OneCycleLR", pr.opt, pr.ref_opt, one_cycle(pr.opt), one_cycle(pr.ref_opt)))
    for what, make, sched in OPTIMIZERS:
        o, r = make(list(pr.model.parameters())), make(list(pr.ref.parameters()))
        runs.append((what, o, r, sched(o), sched(r)))
    for what, opt, ref_opt, sch, ref_sch in runs:
        for step in range(steps):
            pr.zero_grad()
            pr.loss(step % K).backward()
            pr.ref_loss(step % K).backward()
            torch.nn.utils.clip_grad_norm_(pr.model.parameters(), 1.0)
            torch.nn.utils.clip_grad_norm_(pr.ref.parameters(), 1.0)
            opt.step()
            ref_opt.step()
            sch.step()
            ref_sch.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], what
        pr.check_params(what)
    pr.zero_grad()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="bert or gpt2, or both separated by a comma")
    p.add_argument("--checks", default="freeze,calls,clip,accum,optim")
    p.add_argument("--replicas", default="")
    p.add_argument("--partition-num", type=int, default=0)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch of one call")
    p.add_argument("--steps", type=int, default=3, help="steps per optimizer")
    p.add_argument("--schedule", default="auto")
    return p.parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    checks = a.checks.split(",")
    for name in a.model.split(","):
        pr = Pair(name, a, ctx.rank, ctx.world_size)
        if "freeze" in checks:  # first: the model is deployed with the embedding frozen
            check_freeze_unfreeze(pr)
        if "calls" in checks:
            check_calls_between(pr)
        if "clip" in checks:
            check_clip(pr)
        if "accum" in checks:
            check_accumulation(pr)
            check_accumulation_reshaped(pr)
            check_abandoned_accumulation(pr)
            check_no_sync_around_backward_only(pr)
            check_zero_grad_between_forward_and_backward(pr)
        if "optim" in checks:
            check_optimizers(pr, a.steps)
        plan = pr.model.plan
        assert plan is not None
        print(f"PASS {name} rank {ctx.rank} checks {a.checks}", flush=True)
        if ctx.rank == 0:
            print(f"SCHEDULE {plan.schedule} REPLICAS {[s.replicas for s in plan.stages]}", flush=True)


def main() -> None:
    case_batch.main(parse, run)


if __name__ == "__main__":
    main()
