"""Check that rannc runs your model exactly like the original, on the global batch.

    python -m rannc.check mymodels:make --ranks 4 --partition-num 2 --microbatches 2
    python -m rannc.check mymodels:make --ranks 3 --replicas 2,1 --schedule 1f1b
    python -m rannc.check path/to/models.py:make            # one process

The factory protocol. ``MODULE:FACTORY`` names a module (dotted, importable from the current
directory, or a ``.py`` file) and a callable in it taking no arguments. It returns either a
:class:`Case` or a tuple ``(model, batch)`` or ``(model, batch, loss)``:

* ``model``: the unwrapped ``nn.Module`` in training mode. Every rank calls the factory after
  ``torch.manual_seed(seed)``, so building it from torch's RNG gives every rank the same model.
  On several ranks use dropout 0 (or none): each rank draws its masks for its own rows, the
  reference here for the whole batch. In one process the reference's call starts from the
  generator state rannc's did, so random ops (dropout, a router's sampling) are compared too.
* ``batch(n)``: the GLOBAL batch of ``n`` rows: a dict of keyword inputs, a tuple of positional
  inputs, or one tensor. Tensors whose first dimension is ``n`` are split by rows across the
  ranks (rank order, the first ranks one row more when ``n`` does not divide); other inputs go
  to every rank whole. Called after ``torch.manual_seed(seed + 1 + step)``.
* ``Case.reshaped(n)`` (optional): the global batch in another shape, e.g. a shorter sequence,
  as dynamic padding makes. With two steps or more, the last training step accumulates the
  gradients of two calls, as gradient accumulation does: the first on the usual batch under
  ``no_sync()``, the second on this one (or, without it, on another batch of the usual shape),
  each loss halved. The second is captured again and its graph placed on the deployed stages
  (`rannc.derive`), so the checks cover it and an accumulation over both graphs. The eval
  forward takes the first step's batch again.
* ``loss(output, inputs)`` (optional): the scalar each rank backpropagates, from ITS output
  rows and ITS input rows (a DDP-style per-rank loss). By default: the output's ``loss`` (a
  Hugging Face ``ModelOutput``'s, or a dict's "loss") when it is a scalar, or the output itself
  when the model returns one floating scalar -- the global loss, the same on every rank -- else
  the mean of squares of every floating batch output.

What is compared, each rank against a copy of the original model fed the whole global batch
(fp32 tolerances ``rtol``/``atol``, as ``torch.testing.assert_close``):

* ``outputs``: every tensor of the output, this rank's rows of batch outputs and the global value
  of scalars, at every training step;
* ``loss``: this rank's loss against the reference's for the same rows;
* ``grads``: every parameter this rank holds; the reference is the average over ranks of the
  gradient of each rank's loss on the global batch (DDP semantics);
* ``params``: those parameters after ``steps`` AdamW steps (eps 1e-4: with a tiny eps Adam turns
  float noise in gradients that are zero into full-size steps, in either run);
* ``state_dict``: the gathered ``state_dict()`` on rank 0 (parameters and buffers, e.g.
  BatchNorm's running statistics) against the reference's;
* ``eval outputs``: an ``eval()`` forward under ``torch.no_grad()``.

``--dtype float64`` runs both models and every floating input in float64 (tolerances
``torch.testing``'s for float64 unless given): it tells a defect from float32 conditioning. A
model whose fp32 gradients carry rounding errors far above their elements' size (BatchNorm over
a few rows in deep convolutional networks: the unwrapped model's own fp32 gradients differ from
its float64 ones as much) fails the fp32 check in any layout that sums in another order, and AdamW
turns those errors into sign flips of its steps; in float64 a correct layout agrees to 1e-10.

``--ranks 1`` (the default) runs in this process; more ranks are launched with ``mpiexec`` (the
one next to this Python, else PATH's), or run as they are when this command itself was started
by a launcher. The command prints one table per model and exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

#: The prefix of the one machine-readable line printed per model (rank 0).
RESULT_PREFIX = "@@rannc.check "
RTOL, ATOL = 1e-4, 1e-5
RTOL64, ATOL64 = 1e-7, 1e-7  # --dtype float64 (torch.testing.assert_close's for float64)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
CHECKS = ("outputs", "loss", "grads", "params", "state_dict", "eval outputs")

Batch = Any  # dict of keyword inputs, tuple of positional inputs, or one tensor
LossFn = Callable[[Any, Batch], torch.Tensor]


@dataclass
class Case:
    """What a factory returns (a tuple ``(model, batch[, loss])`` is read as one)."""

    model: nn.Module
    batch: Callable[[int], Batch]
    loss: LossFn | None = None
    batch_size: int | None = None  # the global batch, unless --batch says otherwise
    name: str = ""
    # the global batch in another shape (a shorter sequence): the second call of the last
    # training step (an accumulation of two) takes it
    reshaped: Callable[[int], Batch] | None = None


@dataclass
class CheckResult:
    """One check of one model, merged over ranks: the worst error and where it was."""

    check: str
    passed: bool = True
    max_abs: float = 0.0
    max_rel: float = 0.0  # over elements whose reference is at least atol in size
    compared: int = 0  # tensors compared
    worst: str = ""  # the tensor with the largest tolerance excess, and its rank
    error: str = ""  # why the check could not run, or what did not match besides values
    _excess: float = field(default=-math.inf, repr=False)  # max(|d| - atol - rtol*|want|)

    def add(self, what: str, got: Any, want: Any, rtol: float, atol: float) -> None:
        """Compare one tensor (None counts as zeros of the other's shape: an unused gradient)."""
        self.compared += 1
        if got is None and want is None:
            return
        if got is None:
            got = torch.zeros_like(want)
        if want is None:
            want = torch.zeros_like(got)
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
            if got != want:
                self.fail(f"{what}: {got!r} != {want!r}")
            return
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
            return
        if not got.is_floating_point() and not got.is_complex():
            if not torch.equal(got, want):
                self.fail(f"{what}: integer values differ")
            return
        g, w = got.detach().double().cpu(), want.detach().double().cpu()
        if g.numel() == 0:
            return
        nan = torch.isnan(g) | torch.isnan(w)
        if not torch.equal(torch.isnan(g), torch.isnan(w)):
            self.fail(f"{what}: NaN in {int(torch.isnan(g).sum())} places, reference in "
                      f"{int(torch.isnan(w).sum())}")
        d = torch.where(nan, 0.0, (g - w).abs())
        d = torch.where(torch.isinf(g) & (g == w), 0.0, d)
        # Relative error where it means something: below atol the absolute error is the judge
        # (a gradient that is zero up to float noise would show 1e18 here).
        rel = torch.where(w.abs() >= atol, d / w.abs().clamp_min(atol), 0.0)
        excess = float((d - atol - rtol * w.abs()).max())
        self.max_abs = max(self.max_abs, float(d.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        if excess > self._excess:
            self._excess, self.worst = excess, what
        if excess > 0:
            self.passed = False

    def fail(self, error: str) -> None:
        self.passed = False
        if not self.error:
            self.error = error

    def merge(self, other: CheckResult) -> None:
        self.passed = self.passed and other.passed
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)
        self.compared += other.compared
        if other._excess > self._excess:
            self._excess, self.worst = other._excess, other.worst
        self.error = self.error or other.error


@dataclass
class CaseReport:
    """A model's results over every rank."""

    name: str
    checks: list[CheckResult]
    seconds: float
    plan: str = ""  # "2 stages, replicas [2, 1], 2 microbatches, 1f1b" (or "one process")
    error: str = ""  # the exception that stopped the case, if any
    cpu_seconds: float = 0.0  # summed over ranks: what the check costs a machine

    @property
    def passed(self) -> bool:
        return not self.error and all(c.passed for c in self.checks)

    def to_json(self) -> str:
        d = {"name": self.name, "passed": self.passed, "seconds": round(self.seconds, 2),
             "cpu_seconds": round(self.cpu_seconds, 2),
             "plan": self.plan, "error": self.error,
             "checks": [{k: v for k, v in asdict(c).items() if not k.startswith("_")}
                        for c in self.checks]}
        return json.dumps(d)


# -- loading a factory ------------------------------------------------------------------------
def load_factory(spec: str) -> Callable[[], Any]:
    """``MODULE:FACTORY``: a dotted module importable from here, or a path to a ``.py`` file."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"rannc.check: {spec!r} is not MODULE:FACTORY (e.g. mymodels:make, "
                         "or path/to/models.py:make)")
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = Path(mod_name).resolve()
        if not path.is_file():
            raise SystemExit(f"rannc.check: no file {path} (from {spec!r})")
        s = importlib.util.spec_from_file_location(path.stem, path)
        if s is None or s.loader is None:
            raise SystemExit(f"rannc.check: cannot import {path}")
        module = importlib.util.module_from_spec(s)
        sys.modules[path.stem] = module
        s.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SystemExit(f"rannc.check: {mod_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def as_case(made: Any, name: str) -> Case:
    if isinstance(made, Case):
        if not made.name:
            made.name = name
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        return Case(made[0], made[1], made[2] if len(made) == 3 else None, name=name)
    raise TypeError(f"the factory {name} returned {type(made).__name__}; return a rannc.check.Case "
                    "or a tuple (model, batch_fn) or (model, batch_fn, loss_fn)")


def in_dtype(case: Case, dtype: str) -> Case:
    """The case with its model's floating parameters and buffers and its batches' floating
    tensors in `dtype` (float32: unchanged)."""
    if dtype == "float32":
        return case
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    to = DTYPES[dtype]

    def cast(x: Any) -> Any:
        return x.to(to) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def batches(make: Callable[[int], Batch]) -> Callable[[int], Batch]:
        return lambda n: pytree.tree_map(cast, make(n))

    return Case(case.model.to(to), batches(case.batch), case.loss, case.batch_size, case.name,
                None if case.reshaped is None else batches(case.reshaped))


# -- rows and losses --------------------------------------------------------------------------
def local_sizes(n: int, world: int) -> list[int]:
    """Rows per rank: the first ranks get one more when ``world`` does not divide ``n``."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def row_ranges(n: int, world: int) -> list[tuple[int, int]]:
    sizes = local_sizes(n, world)
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(world)]


def input_rows(batch: Batch, rows: tuple[int, int], n: int) -> Batch:
    """A rank's part of the global batch: tensors whose first dimension is ``n``, cut by rows."""
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n:
            return x[rows[0]:rows[1]]
        return x
    return pytree.tree_map(cut, batch)


def output_rows(out: Any, rows: tuple[int, int], n: int) -> Any:
    """A rank's rows of the reference output: a batch output (first dimension a multiple of n,
    e.g. batch x sequence flattened) is cut; scalars and other values are global."""
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % n == 0 and x.shape[0] >= n:
            k = x.shape[0] // n
            return x[rows[0] * k:rows[1] * k]
        return x
    return pytree.tree_map(cut, out)


def rank_rows(want: Any, got: Any, rows: tuple[int, int], n: int) -> Any:
    """A rank's rows of the reference output `want`, to compare with the rank's output `got`:
    a tensor of `want` is cut along the one dimension where the rank's tensor has the rank's
    share of it (a multiple of n) and the same size elsewhere -- the first (batch x sequence
    flattened) or another (XLNet's memories, sequence x batch x hidden); else as
    `output_rows` cuts it."""
    w_leaves, w_spec = pytree.tree_flatten(want)
    g_leaves, _ = pytree.tree_flatten(got)
    if len(g_leaves) != len(w_leaves):
        return output_rows(want, rows, n)
    mine = rows[1] - rows[0]

    def cut(w: Any, g: Any) -> Any:
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and w.dim() == g.dim():
            differ = [d for d in range(w.dim()) if w.shape[d] != g.shape[d]]
            if len(differ) == 1:
                d = differ[0]
                k = w.shape[d] // n
                if w.shape[d] == k * n and g.shape[d] == k * mine:
                    return w.narrow(d, rows[0] * k, mine * k)
        return output_rows(w, rows, n)
    return pytree.tree_unflatten([cut(w, g) for w, g in zip(w_leaves, g_leaves, strict=True)],
                                 w_spec)


def call(model: Any, batch: Batch, unwrapped: bool = False) -> Any:
    """`model` on `batch`; `unwrapped`: called as RaNNCModule calls the model it wraps (with
    use_cache=False where its config asks for a key/value cache: `rannc.calls.without_cache`)."""
    args = () if isinstance(batch, dict) else tuple(batch) if isinstance(batch, (tuple, list)) \
        else (batch,)
    kwargs = batch if isinstance(batch, dict) else {}
    if unwrapped:
        from rannc.calls import without_cache

        kwargs = without_cache(model, kwargs, say=False)
    return model(*args, **kwargs)


def _scalar_loss(out: Any) -> torch.Tensor | None:
    """The output's scalar `loss` (a ModelOutput's, a dict's), or the output itself where the
    model returns one floating scalar (`return F.mse_loss(...)`)."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 and out.is_floating_point() else None
    loss = None
    if isinstance(out, dict) or hasattr(out, "keys"):
        with contextlib.suppress(KeyError, TypeError):
            loss = out["loss"]
    if loss is None:
        loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def default_loss(out: Any, inputs: Batch) -> torch.Tensor:
    """The output's scalar ``loss`` if it has one (or the output, where it is one floating
    scalar), else the mean of squares of its floating batch outputs (summed over outputs), in
    float32 or the outputs' wider dtype (a float64 check's loss is float64: rounded to float32
    its value differed with the rows each rank summed, by 1.5e-8, which the check then took
    for the model's)."""
    loss = _scalar_loss(out)
    if loss is not None:
        return loss
    terms = [x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean()
             for x in pytree.tree_leaves(out)
             if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0]
    if not terms:
        raise TypeError("the model's output has no scalar 'loss' and no floating batch output; "
                        "give the factory a loss(output, inputs) function")
    return torch.stack(terms).sum()


# -- one model on this rank -------------------------------------------------------------------
@dataclass
class Settings:
    """How to run the check (what the command line gives)."""

    options: dict[str, Any] = field(default_factory=dict)  # RaNNCModule keyword options
    batch: int | None = None
    steps: int = 3
    seed: int = 0
    rtol: float = RTOL
    atol: float = ATOL
    lr: float = 1e-2
    dtype: str = "float32"  # or "float64": the model and every floating input (see above)


def _world() -> tuple[int, int]:
    from rannc import dist as rdist

    if rdist.get_world_size() > 1:
        ctx = rdist.init_process_group(float(os.environ.get("RANNC_TIMEOUT_S", "120")))
        return ctx.rank, ctx.world_size
    return 0, 1


def _gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, obj)
    return every


def _plan_text(wrapped: Any, world: int) -> str:
    if world == 1:
        return "one process"
    plan = getattr(wrapped, "plan", None)
    if plan is None:
        return ""
    reps = [st.replicas for st in plan.stages]
    copies = world // max(1, sum(reps))
    text = f"{len(plan.stages)} stages, replicas {reps}"
    if copies > 1:
        text += f" x{copies}"
    return text + f", {plan.microbatches} microbatches, {plan.schedule}"


def run_case(name: str, factory: Callable[[], Any], s: Settings) -> CaseReport:
    """Build the model (on every rank the same), run it wrapped and unwrapped, compare; the
    results are merged over ranks, so every rank returns the same report."""
    import rannc

    rank, world = _world()
    t0, c0 = time.perf_counter(), time.process_time()
    checks = {c: CheckResult(c) for c in CHECKS}
    error, plan = "", ""
    try:
        torch.manual_seed(s.seed)
        case = in_dtype(as_case(factory(), name), s.dtype)
        plan = _compare(case, s, rank, world, checks, rannc)
    except Exception as e:  # noqa: BLE001 - reported per model; the next model still runs
        error = f"{type(e).__name__}: {e}".strip()
        traceback.print_exc()
    every = _gather((list(checks.values()), error, plan, time.process_time() - c0), world)
    merged = [CheckResult(c) for c in CHECKS]
    for r, (cs, _err, _plan, _cpu) in enumerate(every):
        for m, c in zip(merged, cs, strict=True):
            if c.worst:
                c.worst = f"{c.worst} (rank {r})"
            m.merge(c)
    errors = [f"rank {r}: {err}" for r, (_c, err, _p, _t) in enumerate(every) if err]
    error = errors[0] if errors else ""
    if len(errors) > 1 and all(e.split(": ", 1)[1] == errors[0].split(": ", 1)[1] for e in errors):
        error = "every rank: " + errors[0].split(": ", 1)[1]
    plan = next((p for _c, _e, p, _t in every if p), plan)
    return CaseReport(name, merged, time.perf_counter() - t0, plan, error,
                      sum(t for *_x, t in every))


def _compare(case: Case, s: Settings, rank: int, world: int, checks: dict[str, CheckResult],
             rannc: Any) -> str:
    model = case.model
    model.train()
    ref = copy.deepcopy(model)
    loss_fn = case.loss or default_loss
    n = s.batch or case.batch_size or 8
    ranges = row_ranges(n, world)
    mine = ranges[rank]
    opt_w = torch.optim.AdamW(model.parameters(), lr=s.lr, eps=1e-4)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=s.lr, eps=1e-4)
    wrapped = rannc.RaNNCModule(model, opt_w, **s.options)
    ref_params = dict(ref.named_parameters())
    tol = (s.rtol, s.atol)
    first: Batch = None
    for step in range(s.steps):
        torch.manual_seed(s.seed + 1 + step)
        # the last step accumulates two calls, the second on the reshaped batch
        micro: list[tuple[Batch, str]] = [(case.batch(n), f"step {step}")]
        if 0 < step == s.steps - 1:
            second = (case.reshaped or case.batch)(n)
            micro = [(micro[0][0], f"step {step} (accumulated 1 of 2, no_sync)"),
                     (second, f"step {step} (accumulated 2 of 2"
                              + (", reshaped)" if case.reshaped else ")"))]
        first = micro[0][0] if first is None else first
        for k, (batch, label) in enumerate(micro):
            sync = contextlib.nullcontext() if k == len(micro) - 1 else wrapped.no_sync()
            local = input_rows(batch, mine, n)
            draws = torch.get_rng_state()
            with sync:
                out = call(wrapped, local)
                if world == 1:  # in one process rannc draws what the model draws (dropout)
                    torch.set_rng_state(draws)
                ref_out = call(ref, batch, unwrapped=True)
                _compare_outputs(checks["outputs"], label, out, rank_rows(ref_out, out, mine, n),
                                 tol)
                loss = loss_fn(out, local)
                # DDP semantics: the gradient is the average over ranks of each rank's loss's
                # gradient.
                per_rank = [loss_fn(output_rows(ref_out, rr, n), input_rows(batch, rr, n))
                            for rr in ranges]
                checks["loss"].add(f"{label} loss", loss, per_rank[rank], *tol)
                (loss / len(micro)).backward()
                (torch.stack(per_rank).sum() / (world * len(micro))).backward()
        for pn, p in wrapped.named_parameters():
            checks["grads"].add(f"{label} grad {pn}", p.grad, ref_params[pn].grad, *tol)
        opt_w.step()
        opt_r.step()
        opt_w.zero_grad()
        opt_r.zero_grad()
    for pn, p in wrapped.named_parameters():
        checks["params"].add(f"param {pn}", p.detach(), ref_params[pn].detach(), *tol)
    sd = wrapped.state_dict()  # a collective once deployed: every rank calls it
    if rank == 0:
        _compare_state(checks["state_dict"], sd, ref.state_dict(), tol)
    wrapped.eval()
    ref.eval()
    with torch.no_grad():
        local = input_rows(first, mine, n)
        draws = torch.get_rng_state()
        got = call(wrapped, local)
        if world == 1:  # (random ops in eval too: ViTMAE masks patches at random in eval())
            torch.set_rng_state(draws)
        _compare_outputs(checks["eval outputs"], "eval", got,
                         rank_rows(call(ref, first, unwrapped=True), got, mine, n), tol)
    return _plan_text(wrapped, world)


def _compare_outputs(check: CheckResult, what: str, got: Any, want: Any,
                     tol: tuple[float, float]) -> None:
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if len(g_leaves) != len(w_leaves):
        check.fail(f"{what}: {len(g_leaves)} outputs, the reference {len(w_leaves)} "
                   f"({g_spec} vs {w_spec})")
        return
    names = _leaf_names(want)
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        if isinstance(w, torch.Tensor) or isinstance(g, torch.Tensor):
            check.add(f"{what} output {names[i] if i < len(names) else i}", g, w, *tol)


def _leaf_names(tree: Any) -> list[str]:
    try:
        paths, _ = pytree.tree_flatten_with_path(tree)
        return [pytree.keystr(p) or "out" for p, _ in paths]
    except Exception:  # noqa: BLE001 - names are a nicety; a type without key paths goes unnamed
        return []


def _compare_state(check: CheckResult, got: dict[str, Any], want: dict[str, Any],
                   tol: tuple[float, float]) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        check.fail(f"keys missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                   f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
    for k in sorted(set(got) & set(want)):
        check.add(f"state {k}", got[k], want[k], *tol)


# -- running several models and printing ------------------------------------------------------
def run_all(targets: Sequence[str], s: Settings, out: Any = None) -> list[CaseReport]:
    """Run every target on this rank (each rank of a launch runs this); rank 0 prints a table
    and a machine-readable line per model as soon as it is done."""
    out = out or sys.stdout
    reports = []
    for spec in targets:
        name = spec.rpartition(":")[2]
        try:
            factory = load_factory(spec)
        except SystemExit as e:  # every rank fails alike: no collective is left waiting
            rep = CaseReport(name, [], 0.0, error=str(e))
        else:
            rep = run_case(name, factory, s)
        reports.append(rep)
        if _rank() == 0:
            print(format_report(rep, s), file=out, flush=True)
            print(RESULT_PREFIX + rep.to_json(), file=out, flush=True)
    return reports


def _rank() -> int:
    from rannc import dist as rdist

    return rdist.get_rank()


def format_report(rep: CaseReport, s: Settings) -> str:
    head = f"{rep.name}: {'PASS' if rep.passed else 'FAIL'}"
    if rep.plan:
        head += f"  [{rep.plan}]"
    head += f"  ({rep.seconds:.1f} s, {rep.cpu_seconds:.1f} CPU s; rtol {s.rtol:g}, atol {s.atol:g})"
    lines = [head]
    if rep.error:
        lines.append(f"  error: {rep.error}")
    if rep.checks:
        lines.append(f"  {'check':<13} {'tensors':>7} {'max abs err':>12} {'max rel err':>12}  result")
    for c in rep.checks:
        result = "PASS" if c.passed else "FAIL"
        if c.compared == 0 and c.passed:
            result = "-" if rep.error else "PASS (nothing compared)"
        lines.append(f"  {c.check:<13} {c.compared:>7} {c.max_abs:>12.3g} {c.max_rel:>12.3g}  {result}")
        if not c.passed:
            if c.worst:
                lines.append(f"      worst: {c.worst}")
            if c.error:
                lines.append(f"      {c.error}")
    return "\n".join(lines)


def parse_results(text: str) -> dict[str, dict[str, Any]]:
    """The machine-readable lines of a run's output, by model name."""
    found = {}
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            d = json.loads(line[len(RESULT_PREFIX):])
            found[d["name"]] = d
    return found


# -- the command ------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from rannc.schedule import SCHEDULES

    p = argparse.ArgumentParser(
        prog="python -m rannc.check",
        description="Check a model under rannc against the unwrapped model on the global batch "
                    "(outputs, loss, gradients, parameters after AdamW steps, state_dict, eval).")
    p.add_argument("targets", nargs="+", metavar="MODULE:FACTORY",
                   help="factory returning (model, batch_fn[, loss_fn]) or a rannc.check.Case")
    p.add_argument("--ranks", type=int, default=1, help="ranks to launch with mpiexec (1: here)")
    p.add_argument("--partition-num", type=int, default=None, help="force the stage count")
    p.add_argument("--replicas", default=None, help="force replicas per stage, e.g. 2,1")
    p.add_argument("--microbatches", type=int, default=None, help="force the microbatch count")
    p.add_argument("--schedule", default=None,
                   help=f"auto or one of {', '.join(SCHEDULES)}")
    p.add_argument("--option", action="append", default=[], metavar="NAME=JSON",
                   help="any other rannc option, e.g. --option checkpointing='\"on\"'")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the case's, or 8)")
    p.add_argument("--steps", type=int, default=3, help="training steps (AdamW)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None, help=f"default {RTOL}; float64 {RTOL64}")
    p.add_argument("--atol", type=float, default=None, help=f"default {ATOL}; float64 {ATOL64}")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="float64: tell a defect from float32 conditioning (module docstring)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the launch is killed")
    p.add_argument("--mpiexec", default=None, help="the launcher (default: next to python, or PATH)")
    return p


def settings_from(a: argparse.Namespace) -> Settings:
    options: dict[str, Any] = {}
    if a.partition_num:
        options["partition_num"] = a.partition_num
    if a.replicas:
        options["replicas"] = [int(x) for x in a.replicas.split(",")]
    if a.microbatches:
        options["microbatches"] = a.microbatches
    if a.schedule:
        options["schedule"] = a.schedule
    for item in a.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"rannc.check: --option {item!r} is not NAME=JSON")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    f64 = a.dtype == "float64"
    rtol = a.rtol if a.rtol is not None else (RTOL64 if f64 else RTOL)
    atol = a.atol if a.atol is not None else (ATOL64 if f64 else ATOL)
    return Settings(options, a.batch, a.steps, a.seed, rtol, atol, dtype=a.dtype)


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def launch(argv: Sequence[str], ranks: int, timeout: float, mpiexec: str | None = None) -> int:
    """``mpiexec -n ranks python -m rannc.check ARGV``; the exit status of the launch."""
    exe = mpiexec or find_mpiexec()
    if exe is None:
        raise SystemExit("rannc.check: no mpiexec next to this python or on PATH "
                         "(pip install mpi4py mpich), or start this command under your launcher")
    env = dict(os.environ)
    # N ranks on one machine: without this each would start a thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("HYDRA_LAUNCHER", "fork")  # MPICH: local ranks by fork, never ssh
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "rannc.check", *argv]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"rannc.check: the launch ran past {timeout:.0f} s and was killed", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    from rannc import dist as rdist

    if a.ranks > 1 and rdist.get_world_size() == 1:
        return launch(_without_ranks(argv), a.ranks, a.timeout, a.mpiexec)
    s = settings_from(a)
    with _quiet():
        reports = run_all(a.targets, s)
    if rdist.get_world_size() > 1:
        rdist.shutdown()
    failed = [r.name for r in reports if not r.passed]
    if _rank() == 0:
        print(f"rannc.check: {len(reports) - len(failed)} of {len(reports)} passed"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def _without_ranks(argv: list[str]) -> list[str]:
    """The arguments for the launched ranks: --ranks dropped (each then runs as one rank)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--ranks":
            skip = True
        elif not x.startswith("--ranks="):
            out.append(x)
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hugging Face's warnings about tiny test vocabularies are noise next to the tables."""
    import logging

    lg = logging.getLogger("transformers")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)


if __name__ == "__main__":
    # Through the imported module, not this __main__ copy: factories return rannc.check.Case,
    # which must be the class run_case checks against.
    from rannc.check import main as _main

    sys.exit(_main())
