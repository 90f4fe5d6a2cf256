"""Gradient reduction over the ranks holding each parameter (a stage's replicas, and the stages
sharing a tied parameter): bucketed, each bucket all-reduced asynchronously as soon as its
gradients are final, every bucket waited for before backward() returns, so before the
optimizer step.

Why buckets: one all-reduce per parameter pays a collective's latency hundreds of times; one
over a flat copy of every gradient (what this replaced) doubles the gradients' memory and cannot
start before the last gradient exists. A bucket of about `Config.bucket_mb` is copied into one
buffer, reduced and copied back into `.grad`; at most one such buffer is alive at a time, so the
reduction needs at most one bucket beyond the gradients (`peak_extra_bytes`). A bucket holding
one parameter is reduced in its `.grad` itself, without a buffer.

When a gradient is final: during this stage's last microbatch backward (`arm`), a parameter's
gradient is final once autograd has accumulated into it as often as the stage's parts read it
(the recomputed and the kept part run one backward each, and autograd sums every use within
one backward before it accumulates); `register_post_accumulate_grad_hook` counts. A parameter
that gets fewer accumulations (no gradient path in this call), and every parameter under the
eager schedules (whose backward ran inside forward()), is reduced in `finish`. The buckets of one
process group start strictly in their order on every rank, so the collectives match whatever
order the gradients become final in. A hook never waits: a rank waiting there for a peer that
waits for this rank's next send would deadlock; it only starts buckets whose turn it is.

Semantics are the runtime's (DDP's): gradients are summed over the holders (the 1/W is in the
loss gradient), `no_sync()` keeps local sums in `pending` until the next synchronised backward,
a parameter no holder got a gradient for keeps `.grad` None, and a non-finite gradient on any
rank shows on every rank (`share_overflow`).

Index conventions: k buckets; n parameter names; r ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rannc import health

# (ranks, parameter names, process group or None) per distinct set of holding ranks
ParamGroup = tuple[tuple[int, ...], list[str], Any]


@dataclass
class _Bucket:
    names: list[str]  # one name per distinct parameter, in launch order
    numel: int
    dtype: torch.dtype
    buf: torch.Tensor | None = None  # the flat copy while it is reduced (several parameters)
    work: Any = None  # the async all-reduce

    @property
    def in_place(self) -> bool:
        return len(self.names) == 1


@dataclass
class _Group:
    ranks: tuple[int, ...]
    names: list[str]
    group: Any
    buckets: list[_Bucket]
    started: int = 0  # buckets started so far this backward (they start in order)


@dataclass
class _State:
    """One synchronised backward's bookkeeping."""

    before: dict[str, torch.Tensor | None]
    got: set[str] = field(default_factory=set)  # names with a local gradient (or a pending one)
    base: dict[str, torch.Tensor | None] = field(default_factory=dict)  # .grad before, reduced
    new: dict[str, torch.Tensor | None] = field(default_factory=dict)  # to reduce (None: zeros)
    ready: set[str] = field(default_factory=set)
    counts: dict[int, int] = field(default_factory=dict)  # id(param) -> accumulations seen


class GradReducer:
    """Sums this rank's parameter gradients over their holders, bucket by bucket."""

    def __init__(self, held: Mapping[str, nn.Parameter], groups: Sequence[ParamGroup],
                 first_use: Mapping[str, int], bucket_bytes: int,
                 accumulations: Mapping[int, int]) -> None:
        """`first_use[n]`: the position of parameter n's first reader in the whole graph (the
        same on every rank, so every holder cuts the same buckets; they start in reverse, the
        order backward finishes them). `accumulations[id(p)]`: how many backward passes of
        one microbatch accumulate into p on this stage."""
        self.held: dict[str, nn.Parameter] = {}
        for n, p in held.items():  # a parameter held under two names: reduced under the first
            if all(q is not p for q in self.held.values()):
                self.held[n] = p
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.pending: dict[str, torch.Tensor] = {}  # no_sync: local sums awaiting a reduce
        self.accumulations = dict(accumulations)
        self.groups = [_Group(ranks, mine, g, self._buckets(mine, first_use))
                       for ranks, names, g in groups if g is not None
                       for mine in [[n for n in names if n in self.held]] if mine]
        self._state: _State | None = None
        self._hooks: list[Any] = []
        self._buffered: _Bucket | None = None  # the one bucket whose buffer is alive
        self.extra_bytes = 0  # bytes the reduction holds beyond the gradients, now
        self.peak_extra_bytes = 0  # the most it held, since construction

    def _buckets(self, names: Sequence[str], first_use: Mapping[str, int]) -> list[_Bucket]:
        order = sorted(names, key=lambda n: (-first_use.get(n, -1), n))
        out: list[_Bucket] = []
        cur: list[str] = []
        size = 0
        for n in order:  # a bucket stays within bucket_bytes unless one parameter exceeds it
            p = self.held[n]
            nbytes = p.numel() * p.element_size()
            if cur and (self.held[cur[0]].dtype != p.dtype or size + nbytes > self.bucket_bytes):
                out.append(self._bucket(cur))
                cur, size = [], 0
            cur.append(n)
            size += nbytes
        if cur:
            out.append(self._bucket(cur))
        return out

    def _bucket(self, names: list[str]) -> _Bucket:
        return _Bucket(names, sum(self.held[n].numel() for n in names), self.held[names[0]].dtype)

    # -- one backward --------------------------------------------------------------------------
    def begin(self) -> None:
        """Before this rank's part of a backward: set `.grad` aside (the backward's own
        gradients accumulate from None; `finish` adds the old ones back)."""
        self._drop_hooks()
        self._buffered = None  # (a backward that raised may have left one)
        for grp in self.groups:
            grp.started = 0
            for b in grp.buckets:
                b.buf = b.work = None
        self._state = _State({n: p.grad for n, p in self.held.items()})
        for p in self.held.values():
            p.grad = None

    def arm(self) -> None:
        """The last microbatch's backward on this stage starts: from here a gradient that has
        had all its accumulations is final, and its bucket starts when its turn comes."""
        st = self._state
        if st is None or not self.groups:
            return
        for grp in self.groups:
            for b in grp.buckets:
                for n in b.names:
                    p = self.held[n]
                    # A frozen parameter (requires_grad=False, e.g. Whisper's positional
                    # embeddings) never accumulates: `finish` handles it with the rest.
                    if p.requires_grad and self.accumulations.get(id(p), 0) > 0:
                        self._hooks.append(p.register_post_accumulate_grad_hook(
                            lambda p, n=n: self._accumulated(p, n)))

    def _accumulated(self, p: torch.Tensor, n: str) -> None:
        st = self._state
        if st is None:
            return
        c = st.counts[id(p)] = st.counts.get(id(p), 0) + 1
        if c == self.accumulations[id(p)]:
            self._prepare(n)
            self._start_ready(wait=False)

    def finish(self, sync: bool) -> None:
        """After this rank's part of the backward: sum the gradients over their holders (or,
        unsynchronised, keep the local sums pending) and add what `.grad` held before.

        A parameter that got no gradient on any rank holding it (the loss does not depend on
        it) keeps `.grad` None, as in the original model: an optimizer then skips it, where a
        zero gradient would still apply weight decay and move its Adam moments."""
        self._drop_hooks()
        st = self._state
        if st is None:
            return
        self._state = None
        if not sync:
            self._keep_pending(st)
            return
        for n in self.held:
            if n not in st.ready:
                self._prepare(n, st)
        with health.phase("gradient all-reduce"):
            self._start_ready(wait=True, st=st)
            for grp in self.groups:
                for b in grp.buckets:
                    self._complete(b, st)
            for grp in self.groups:
                # On how many holders each parameter got a gradient. A collective of its own:
                # appended to a bucket it would change how the backend chunks the sum, and with
                # it the float rounding of the gradients.
                names = [n for b in grp.buckets for n in b.names]
                flags = torch.tensor([float(n in st.got) for n in names],
                                     device=self.held[names[0]].device)
                dist.all_reduce(flags, group=grp.group)
                st.got |= {n for n, f in zip(names, flags.tolist(), strict=True) if f > 0}
        for n, p in self.held.items():
            base, r = st.base[n], st.new[n]
            if n not in st.got or r is None:
                p.grad = base
            else:
                p.grad = r if base is None else r.add_(base)

    def _keep_pending(self, st: _State) -> None:
        """no_sync(): this backward's local gradients join the pending local sums (reduced
        together by the next synchronised backward) and show in `.grad`."""
        for n, p in self.held.items():
            if p.grad is None and n not in self.pending:
                p.grad = st.before[n]
                continue
            new = p.grad if p.grad is not None else torch.zeros_like(p)
            pend = self.pending.get(n)
            self.pending[n] = new if pend is None else pend + new
            prev = st.before[n]
            p.grad = new if prev is None else prev + new

    def _prepare(self, n: str, st: _State | None = None) -> None:
        """Parameter n's gradient is final: what to reduce is it plus the pending local sums;
        what is added afterwards is `.grad` from before less those sums."""
        st = st or self._state
        if st is None or n in st.ready:
            return
        st.ready.add(n)
        g = self.held[n].grad
        pend = self.pending.pop(n, None)
        if g is not None or pend is not None:
            st.got.add(n)
        prev = st.before[n]
        st.base[n] = prev if pend is None or prev is None else prev - pend
        st.new[n] = pend if g is None else g if pend is None else g + pend

    def _start_ready(self, wait: bool, st: _State | None = None) -> None:
        """Start, in each group's order, the buckets whose parameters are all final. Without
        `wait`, a bucket needing the buffer while another bucket's is in flight stays for later."""
        st = st or self._state
        if st is None:
            return
        for grp in self.groups:
            while grp.started < len(grp.buckets):
                b = grp.buckets[grp.started]
                if not all(n in st.ready for n in b.names):
                    break
                if not b.in_place and self._buffered is not None:
                    if not wait and not self._buffered.work.is_completed():
                        break
                    self._complete(self._buffered, st)
                # Started from a hook this is still the gradient all-reduce (not the backward
                # around it): a failure in it is reported as such.
                with health.phase("gradient all-reduce"):
                    self._start(b, grp.group, st)
                grp.started += 1

    def _start(self, b: _Bucket, group: Any, st: _State) -> None:
        if b.in_place:
            n = b.names[0]
            t = st.new[n]
            if t is None:  # no local gradient: zeros join the sum (another holder may have one)
                t = st.new[n] = torch.zeros_like(self.held[n])
                self._account(t.numel() * t.element_size())
            b.work = dist.all_reduce(t, group=group, async_op=True)
            return
        buf = torch.empty(b.numel, dtype=b.dtype, device=self.held[b.names[0]].device)
        self._account(buf.numel() * buf.element_size())
        at = 0
        for n in b.names:
            k = self.held[n].numel()
            t = st.new[n]
            if t is None:
                buf[at:at + k].zero_()
            else:
                buf[at:at + k].copy_(t.reshape(-1))
            at += k
        b.buf = buf
        b.work = dist.all_reduce(buf, group=group, async_op=True)
        self._buffered = b

    def _complete(self, b: _Bucket, st: _State) -> None:
        """Wait for bucket b and copy its sums back into the gradients."""
        if b.work is None:
            return
        b.work.wait()
        b.work = None
        if b.in_place:
            t = st.new[b.names[0]]
            if t is not None and b.names[0] not in st.got:
                self._account(-t.numel() * t.element_size())  # becomes .grad only if got
            return
        assert b.buf is not None
        at = 0
        for n in b.names:
            p = self.held[n]
            k = p.numel()
            piece = b.buf[at:at + k].view_as(p)
            t = st.new[n]
            if t is None:
                st.new[n] = piece.clone()  # this parameter's gradient, if any holder got one
            else:
                t.copy_(piece)
            at += k
        self._account(-b.buf.numel() * b.buf.element_size())
        b.buf = None
        if self._buffered is b:
            self._buffered = None

    def _account(self, nbytes: int) -> None:
        self.extra_bytes += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, self.extra_bytes)

    def _drop_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def share_overflow(grads: Sequence[torch.Tensor], device: torch.device) -> None:
    """If any rank's gradients are not finite (an fp16 overflow in one stage), make every
    rank's gradients show it, so that a GradScaler skips the step on every rank and all
    ranks lower the scale alike: GradScaler itself only looks at the local gradients."""
    # One min/max pass per gradient (NaN, inf and -inf all show in its two values) and one
    # sync. isfinite makes four passes with temporaries per gradient, and the inf-norm
    # (_foreach_norm(g, inf)) is not vectorised on CPU: 12.6 ms against aminmax's 0.9 ms for
    # 17 MB of gradients, about 3 % of a small BERT step (benchmarks/runtime_peers.py).
    # A sum or 2-norm would be cheaper still but can overflow on finite fp16 gradients.
    nonempty = [g for g in grads if g.numel()]
    bad = bool(nonempty) and not bool(torch.stack(
        [m.float() for g in nonempty for m in torch.aminmax(g)]).isfinite().all())
    flag = torch.tensor([float(bad)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0 and not bad and grads:
        grads[0].view(-1)[0] = math.inf


__all__ = ["GradReducer", "ParamGroup", "share_overflow"]
