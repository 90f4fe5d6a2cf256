"""BatchNorm in training, in a pipeline of microbatches and stage replicas.

The unwrapped model normalises over the whole batch and updates its running statistics once
per call. In the pipeline each (microbatch, replica) runs the stage on its own rows, so:

* outputs and gradients (`batchnorm="local"`, the default): every (microbatch, replica)
  normalises over its own rows, as DDP without SyncBatchNorm does per rank. With one
  microbatch and one replica per stage holding BatchNorm this is exact. `batchnorm="sync"`
  makes it exact in general: the planner keeps one microbatch (the whole plan) and the
  statistics are summed over the stage's replicas in forward and backward (SyncBatchNorm's
  algebra), so the normalisation is over the global batch.
* running statistics (both modes): deferred, as torchgpipe's DeferredBatchNorm does. The
  microbatches only accumulate per-channel sums and sums of squares; at the end of the call
  the stage's replicas all-reduce them and every replica updates its running mean and
  (unbiased) variance once, from the statistics of the global batch, and
  `num_batches_tracked` counts the call once. So eval() after training normalises with what
  the unwrapped model would have accumulated from the same batches.

How: each training-mode batch-norm op of a stage's fx module (found by op name, before or
after functionalisation: `aten.batch_norm`, `aten.native_batch_norm`,
`aten._native_batch_norm_legit` and its `_functional` form) is replaced by a call of a
`_StageBatchNorm` submodule that computes the same outputs without writing the buffers (the
functional form's "new" running statistics are the old ones, so its copies into the buffers
change nothing) and records the statistics for the deferred update.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from rannc.errors import ConfigError
from rannc.graph.task_graph import TaskGraph, ValueKind

log = logging.getLogger(__name__)

MODES = ("local", "sync")

# op name -> what it returns: "out" (the output alone), "stats" (output, mean, inverse std) or
# "functional" (those and the new running mean and variance). Arguments: input, weight, bias,
# running_mean, running_var, training, momentum, eps (and cudnn_enabled for batch_norm).
BATCH_NORM_OPS = {
    "aten.batch_norm.default": "out",
    "aten.native_batch_norm.default": "stats",
    "aten._native_batch_norm_legit.default": "stats",
    "aten._native_batch_norm_legit_functional.default": "functional",
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"Config.batchnorm={mode!r} is not one of {', '.join(MODES)}; use "
                          "'local' (each microbatch and replica normalises over its own rows, as "
                          "DDP) or 'sync' (exact: statistics over the global batch)")
    return mode


def batch_norm_tasks(graph: TaskGraph) -> list[int]:
    """Indices of the graph's batch-norm tasks (training or not: the op name alone says)."""
    return [i for i, t in enumerate(graph.tasks) if t.op in BATCH_NORM_OPS]


def training_batch_norms(gm: fx.GraphModule, graph: TaskGraph) -> list[int]:
    """Indices of the batch-norm tasks that run in training mode (their `training` argument,
    read from the captured fx graph, is True)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for i in batch_norm_tasks(graph):
        node = nodes.get(graph.tasks[i].name)
        if node is not None and _arg(node, 5, "training") is True:
            out.append(i)
    return out


def _arg(node: fx.Node, i: int, name: str) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if i < len(node.args) else None


@dataclass
class _Site:
    """One training-mode batch-norm call in this rank's stage."""

    key: str  # the fx node's name
    module_path: str
    running_mean: str | None  # buffer names in the model (None: track_running_stats=False)
    running_var: str | None
    tracked: str | None  # num_batches_tracked beside them
    momentum: float
    channels: int


@dataclass
class BatchNormState:
    """The stage's batch-norm calls and this call's accumulated statistics."""

    mode: str
    group: Any  # the stage's replicas' process group (None: one replica)
    world: bool = False  # the stage's replicas are every rank (its statistics sum over the world)
    sites: dict[str, _Site] = field(default_factory=dict)  # in graph order
    sums: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # key -> [S, SS, N]
    # key -> (mean, 1 / sqrt(var + eps), rows per channel, eps) per microbatch (`add_moments`)
    moments: dict[str, list[tuple[torch.Tensor, torch.Tensor, float, float]]] = field(
        default_factory=dict)
    accumulate: bool = False  # only the first forward of a microbatch (not recompute) counts
    # (num_batches_tracked names, their values when the call began)
    tracked_before: tuple[list[str], torch.Tensor | None] = ([], None)
    # this call's statistics while their all-reduce runs (`post_call`): the flat sums, the work
    _posted: tuple[torch.Tensor, Any] | None = None

    def add(self, key: str, x: torch.Tensor) -> None:
        """Count microbatch input x's per-channel sums (two passes over x in float64)."""
        dims = [d for d in range(x.dim()) if d != 1]
        x64 = x.detach().to(torch.float64)
        n = torch.tensor([x.numel() / max(x.shape[1], 1)], dtype=torch.float64, device=x.device)
        self._add(key, [x64.sum(dims), (x64 * x64).sum(dims), n])

    def add_moments(self, key: str, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                    eps: float) -> None:
        """Count microbatch input x's per-channel statistics from the mean and
        1 / sqrt(var + eps) the batch-norm kernel computed for it anyway (float32 or wider),
        turned into sums once per call for every site together (`_totals`). No pass over x:
        the float64 sums of `add` cost about as much as the batch norm itself (ResNet, CPU),
        and even a few small operations per microbatch and site add up (52 sites x 4
        microbatches a step). The variance comes back to within a few float32 roundings of
        (var + eps), what the kernel itself normalised with."""
        n = x.numel() / max(x.shape[1], 1)
        self.moments.setdefault(key, []).append((mean.detach(), rstd.detach(), n, eps))

    def _totals(self, keys: list[str], device: torch.device) -> list[torch.Tensor]:
        """This call's [S, SS, N] of every site in `keys`, summed over its microbatches, as
        [S of every site, SS of every site, N of every site] (float64; zeros where a site did
        not run). When every site recorded the same number of microbatches through
        `add_moments` (the usual case), in a dozen operations for all sites together, which is
        what a ResNet stage's per-site arithmetic cost (about 1,000 small operations a step)."""
        chans = [self.sites[k].channels for k in keys]
        runs = {len(self.moments.get(k, ())) for k in keys}
        if not self.sums and len(runs) == 1 and 0 not in runs:
            m = runs.pop()
            recs = [self.moments[k][i] for i in range(m) for k in keys]  # microbatch-major
            shape = (m, sum(chans))
            mean = torch.cat([r[0] for r in recs]).to(torch.float64).view(shape)
            rstd = torch.cat([r[1] for r in recs]).to(torch.float64).view(shape)
            per_site = torch.tensor([r[2] for r in recs], dtype=torch.float64,
                                    device=device).view(m, len(keys))
            counts = torch.tensor(chans, device=device)
            n = per_site.repeat_interleave(counts, dim=1)  # (m, channels of every site)
            eps = torch.tensor([r[3] for r in recs[:len(keys)]], dtype=torch.float64,
                               device=device).repeat_interleave(counts)
            var = (rstd.pow(-2) - eps).clamp_min(0)
            return [(mean * n).sum(0), ((var + mean * mean) * n).sum(0), per_site.sum(0)]
        for key, rs in self.moments.items():  # (mixed: site by site)
            mean = torch.stack([r[0] for r in rs]).to(torch.float64)  # (micro, C)
            rstd = torch.stack([r[1] for r in rs]).to(torch.float64)
            eps_m = torch.tensor([r[3] for r in rs], dtype=torch.float64, device=device)
            n_m = torch.tensor([r[2] for r in rs], dtype=torch.float64, device=device)
            var = (rstd.pow(-2) - eps_m[:, None]).clamp_min(0)
            self._add(key, [(mean * n_m[:, None]).sum(0),
                            ((var + mean * mean) * n_m[:, None]).sum(0), n_m.sum().reshape(1)])
        out: list[list[torch.Tensor]] = [[], [], []]
        for k, c in zip(keys, chans, strict=True):
            sums = self.sums.get(k) or [torch.zeros(c, dtype=torch.float64, device=device),
                                        torch.zeros(c, dtype=torch.float64, device=device),
                                        torch.zeros(1, dtype=torch.float64, device=device)]
            for part, t in zip(out, sums, strict=True):
                part.append(t)
        return [torch.cat(part) for part in out]

    def _add(self, key: str, new: list[torch.Tensor]) -> None:
        old = self.sums.get(key)
        self.sums[key] = new if old is None else [a + b for a, b in zip(old, new, strict=True)]

    def begin_call(self, buffers: dict[str, torch.Tensor]) -> None:
        self.sums = {}
        self.moments = {}
        if self._posted is not None and self._posted[1] is not None:
            self._posted[1].wait()  # (a call that raised between post_call and finish_call)
        self._posted = None
        names = sorted({s.tracked for s in self.sites.values() if s.tracked in buffers})
        # one copy of every num_batches_tracked (the graph counts each microbatch)
        self.tracked_before = (names, torch.stack([buffers[t].detach() for t in names])
                               if names else None)

    def post_call(self, device: torch.device) -> None:
        """Start summing this call's statistics over the stage's replicas (every replica calls
        this, with zeros for what it did not run), without waiting: `finish_call` waits. The
        caller may start its own collectives in between, so that the ranks wait for both at
        once (each blocking wait costs a wake-up; on the CPU ranks here up to milliseconds)."""
        if not self.sites or self._posted is not None:
            return
        flat = self.call_sums(device)
        work = dist.all_reduce(flat, group=self.group, async_op=True) \
            if self.group is not None else None
        self._posted = (flat, work)

    def call_sums(self, device: torch.device) -> torch.Tensor:
        """This call's statistics as one float64 vector [S..., SS..., N...], to be summed over
        the stage's replicas (by `post_call`, or by the caller in a collective of its own, then
        handed back with `adopt`)."""
        flat = torch.cat(self._totals(list(self.sites), device))
        self.sums, self.moments = {}, {}
        return flat

    def adopt(self, summed: torch.Tensor, work: Any) -> None:
        """`call_sums`' vector as it will be once `work` (an all-reduce over every replica of
        the stage, started by the caller) completes: `finish_call` waits for it."""
        self._posted = (summed, work)

    def finish_call(self, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        """Update the running statistics once, from the global batch's statistics summed over
        the stage's replicas (`post_call` first, if the caller has not)."""
        if not self.sites:
            return
        self.post_call(device)
        assert self._posted is not None
        flat, work = self._posted
        self._posted = None
        if work is not None:
            work.wait()
        keys = list(self.sites)
        chans = [self.sites[k].channels for k in keys]
        c_all = sum(chans)
        s, ss, n_site = flat[:c_all], flat[c_all:2 * c_all], flat[2 * c_all:]
        n = n_site.repeat_interleave(torch.tensor(chans, device=device))
        mean = s / n
        var = (ss / n - mean * mean).clamp_min(0) * (n / (n - 1).clamp_min(1))
        # (site by site as before: rm * (1 - m) + mean * m; the same arithmetic, batched: one
        # conversion to the buffers' dtype for every site, one foreach update per momentum)
        dtypes = {buffers[s.running_mean].dtype for s in self.sites.values()
                  if s.running_mean is not None}
        conv = dtypes.pop() if len(dtypes) == 1 else None
        mean_t = mean.to(conv) if conv is not None else mean
        var_t = var.to(conv) if conv is not None else var
        todo: dict[tuple[float, torch.dtype], list[list[torch.Tensor]]] = {}
        counted: dict[str, int] = {}
        for k, mean_k, var_k, n_k in zip(keys, mean_t.split(chans), var_t.split(chans),
                                         n_site.tolist(), strict=True):
            site = self.sites[k]
            if n_k < 1 or site.running_mean is None or site.running_var is None:
                continue
            rm, rv = buffers[site.running_mean], buffers[site.running_var]
            lists = todo.setdefault((site.momentum, rm.dtype), [[], [], [], []])
            for lst, t in zip(lists, (rm, rv, mean_k, var_k), strict=True):
                lst.append(t)
            if site.tracked is not None:
                counted[site.tracked] = counted.get(site.tracked, 0) + 1
        with torch.no_grad():
            for (m, dtype), (rms, rvs, means, vars_) in todo.items():
                torch._foreach_mul_(rms + rvs, 1 - m)
                torch._foreach_add_(rms + rvs, [t if t.dtype == dtype else t.to(dtype)
                                                for t in means + vars_], alpha=m)
            # the graph's num_batches_tracked += 1 ran once per microbatch: once per call it is
            names, before = self.tracked_before
            if before is not None:
                now = before + torch.tensor([counted.get(t, 0) for t in names], dtype=before.dtype)
                dst = [buffers[t] for t in names if t in counted]
                src = [x for t, x in zip(names, now.unbind(), strict=True) if t in counted]
                if dst:
                    torch._foreach_copy_(dst, src)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm over the rows of all the stage's replicas (each passes its own rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,  # type: ignore[override]
                bias: torch.Tensor | None, eps: float, group: Any) -> tuple[torch.Tensor, ...]:
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        x64 = x.detach().to(torch.float64)
        n = torch.tensor([x.numel() / max(c, 1)], dtype=torch.float64, device=x.device)
        flat = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), n])
        dist.all_reduce(flat, group=group)
        total = float(flat[2 * c])
        mean = flat[:c] / total
        var = (flat[c:2 * c] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.group, ctx.has_bias = total, group, bias is not None
        mean_out, invstd_out = mean.to(x.dtype), invstd.to(x.dtype)
        ctx.mark_non_differentiable(mean_out, invstd_out)
        return out, mean_out, invstd_out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd = ctx.saved_tensors
        c = xhat.shape[1]
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = [1, c] + [1] * (xhat.dim() - 2)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        flat = torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64)
        dist.all_reduce(flat, group=ctx.group)
        g_dy, g_dy_xhat = (flat[:c] / ctx.total).to(dy.dtype), (flat[c:] / ctx.total).to(dy.dtype)
        scale = invstd.to(dy.dtype) if weight is None else invstd.to(dy.dtype) * weight
        dx = (dy - g_dy.view(shape) - xhat * g_dy_xhat.view(shape)) * scale.view(shape)
        # the parameters' gradients are this replica's part: the runtime sums them over replicas
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class _StageBatchNorm(nn.Module):
    """Stands for one training-mode batch-norm op of a stage: the same outputs, no buffer
    writes; the statistics go to the stage's `BatchNormState`."""

    def __init__(self, state: BatchNormState, key: str, kind: str, momentum: float,
                 eps: float) -> None:
        super().__init__()
        self.state, self.key, self.kind, self.momentum, self.eps = state, key, kind, momentum, eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None) -> Any:
        if self.state.mode == "sync" and self.state.group is not None:
            if self.state.accumulate:
                self.state.add(self.key, x)
            out, mean, rstd = _SyncBatchNorm.apply(x, weight, bias, self.eps, self.state.group)
        else:
            out, mean, rstd = torch.ops.aten._native_batch_norm_legit.no_stats(
                x, weight, bias, True, self.momentum, self.eps)
            if self.state.accumulate:
                if mean.dtype in (torch.float32, torch.float64) and rstd.dtype == mean.dtype:
                    self.state.add_moments(self.key, x, mean, rstd, self.eps)
                else:
                    self.state.add(self.key, x)
        if self.kind == "out":
            return out
        if self.kind == "stats":
            return out, mean, rstd
        return out, mean, rstd, running_mean, running_var


def install(gm: fx.GraphModule, graph: TaskGraph, state: BatchNormState) -> int:
    """Replace the training-mode batch-norm ops of stage module `gm`; returns how many."""
    values = graph.values
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        kind = BATCH_NORM_OPS.get(_op_name(node))
        if kind is None:
            continue
        args = [_arg(node, i, name) for i, name in enumerate(
            ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"))]
        training, momentum, eps = args[5], args[6], args[7]
        if training is not True:
            continue
        if not isinstance(momentum, numbers.Real) or not isinstance(eps, numbers.Real):
            log.warning("rannc: BatchNorm %s has no numeric momentum (momentum=None, a cumulative "
                        "average?); its running statistics update per microbatch", node.name)
            continue
        rm, rv = args[3], args[4]

        def buffer(a: Any) -> str | None:
            if isinstance(a, fx.Node) and a.name in values and values[a.name].kind is ValueKind.BUFFER:
                return values[a.name].target
            return None

        rm_name, rv_name = buffer(rm), buffer(rv)
        tracked = None
        if rm_name is not None and rm_name.endswith("running_mean"):
            tracked = rm_name[: -len("running_mean")] + "num_batches_tracked"
        task = next((t for t in graph.tasks if t.name == node.name), None)
        x_val = args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        c = x_val.shape[1] if isinstance(x_val, torch.Tensor) and x_val.dim() > 1 else None
        if not isinstance(c, int):
            log.warning("rannc: BatchNorm %s: channel count unknown; left as captured", node.name)
            continue
        site = _Site(node.name, task.module_path if task else "", rm_name, rv_name, tracked,
                     float(momentum), c)
        state.sites[node.name] = site
        sub = f"rannc_batch_norm_{n}_{node.name}"
        gm.add_submodule(sub, _StageBatchNorm(state, node.name, kind, float(momentum), float(eps)))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(sub, (args[0], args[1], args[2], rm, rv))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n += 1
    if n:
        gm.graph.lint()
        gm.recompile()
    return n


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "aten":
        return f"aten.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return str(t)


__all__ = ["BATCH_NORM_OPS", "MODES", "BatchNormState", "batch_norm_tasks", "check_mode", "install",
           "training_batch_norms"]
