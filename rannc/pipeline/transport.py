"""Messages between ranks: typed keys, collision-free tags, row pieces, held-back sends.

Every transfer of the pipeline is rows of one value for one microbatch, named by a `Key`
(value, microbatch, kind, stage). The keys a deployment can ever use are known when it is
built (`routes.Routes.channels`), so `Tags` numbers them densely: distinct keys get distinct
tags, and a deployment whose keys would not fit gloo's tag range is refused when it is built
instead of mixing two transfers.

`Transport` is one call's messages: the schedule's executor names what goes where (a key, this
rank's rows, the (rank, rows) pieces at the other end) and never builds a tag or calls isend.
Sends never block (isend); one is waited for and dropped, freeing its tensor, as soon as a
message received proves it arrived (`arrivals.Arrivals`, while a line runs), the rest at the
end of the call. Receives block until the pieces are there. A receive may be posted ahead
(`expect`), while this rank still computes: a gloo transfer only moves once its receive is
posted, so a receive posted when the executor gets to it puts the whole hand-over on the
critical path (ResNet, 2 CPU ranks: 1 to 9 ms per microbatch). A piece for this rank itself is
handed over in memory. A call run on a guessed row layout (no collective at the start of a
step) holds back its sends to other ranks until the ranks' agreement on the layout arrives
(`settle`), at the latest before its first receive from another rank, so nothing computed on a
wrong guess ever leaves the rank; when the guess was wrong `settle` raises `LayoutChanged` and
the call runs again.

Index conventions: r ranks; m microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rannc.errors import RaNNCError
from rannc.graph.task_graph import Value, eval_dim
from rannc.pipeline.rows import Range, intersect

if TYPE_CHECKING:
    from rannc.pipeline.arrivals import Arrivals
    from rannc.validate import CallAgreement

# torch.distributed takes a tag as a C int; gloo refuses negative ones.
MAX_TAG = 2**31 - 1


class Kind(IntEnum):
    """What a message carries."""

    FWD = 0  # rows of a stage input, from the stage computing it (or a model input's owners)
    OUT = 1  # rows of a batch model output, to the ranks owning those rows
    GRAD = 2  # rows of a stage input's gradient, back from the stage reading it
    OUT_GRAD = 3  # rows of a batch model output's gradient, from the ranks owning those rows


@dataclass(frozen=True, slots=True, order=True)
class Channel:
    """A (value, kind, stage) that carries one message per microbatch between two ranks.
    `stage`: for FWD and GRAD the stage reading the value (a value read by two stages held by
    one rank, as under interleaved schedules, travels twice), for OUT and OUT_GRAD the stage
    computing the model output."""

    value: str
    kind: Kind
    stage: int


@dataclass(frozen=True, slots=True)
class Key:
    """One message: a channel's rows for microbatch `micro`."""

    value: str
    micro: int
    kind: Kind
    stage: int


class Tags:
    """Keys -> tags, collision-free: channel index x microbatches + microbatch."""

    def __init__(self, channels: Sequence[Channel], microbatches: int) -> None:
        self.microbatches = max(microbatches, 1)
        self._index = {(c.value, c.kind, c.stage): i for i, c in enumerate(channels)}
        if len(self._index) != len(channels):
            raise ValueError("channels repeat")
        n = len(channels) * self.microbatches
        if n > MAX_TAG + 1:
            raise RaNNCError(
                f"the pipeline needs {n} distinct message tags ({len(channels)} channels x "
                f"{self.microbatches} microbatches), more than torch.distributed's {MAX_TAG + 1}; "
                "use fewer microbatches or stages")

    def __call__(self, key: Key) -> int:
        i = self._index.get((key.value, key.kind, key.stage))
        if i is None or not 0 <= key.micro < self.microbatches:
            raise KeyError(f"no route carries {key}")
        return i * self.microbatches + key.micro


class LayoutChanged(Exception):
    """A call run on the last call's layout found that some rank's batch size changed: it runs
    again on `sizes` (nothing of it has left this rank)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(sizes)
        self.sizes = sizes


@dataclass
class Guess:
    """A call running on a guessed layout: the agreement that confirms it, the sizes guessed,
    and checks to run once the agreement is in (collectives that must follow it)."""

    agreement: CallAgreement
    sizes: list[int]
    checks: list[Callable[[], None]] = field(default_factory=list)


class Transport:
    """One call's messages (see the module docstring)."""

    def __init__(self, rank: int, tags: Tags, values: Mapping[str, Value], device: torch.device,
                 guess: Guess | None = None) -> None:
        self.rank, self.tags, self.values, self.device = rank, tags, values, device
        self.guess = guess
        # per destination rank, its isend works and their keys, waited for when a receive
        # from that rank proves them arrived (`arrivals`) or by `wait_sends`
        self._sends: dict[int, list[tuple[Any, Key]]] = {}
        self.arrivals: Arrivals | None = None  # set while a line of the schedule runs
        self._local: dict[Key, torch.Tensor] = {}  # pieces this rank sent itself
        self._held_back: list[tuple[torch.Tensor, int, Key]] = []  # (piece, rank, key)
        # receives posted ahead (`expect`): per key, per piece its buffer and work (None: local)
        self._posted: dict[Key, list[tuple[torch.Tensor, Any] | None]] = {}
        self._received: set[Key] = set()  # keys this call has received (none is posted twice)

    # -- rows ----------------------------------------------------------------------------------
    def row_slice(self, x: torch.Tensor, v: str, base: Range, rows: Range) -> torch.Tensor:
        """Rows `rows` of x, which holds value v's rows `base` (a view, no copy)."""
        val = self.values[v]
        k, d = val.batch_scale, val.batch_dim or 0
        return x.narrow(d, (rows[0] - base[0]) * k, (rows[1] - rows[0]) * k)

    def empty(self, v: str, n_rows: int) -> torch.Tensor:
        """An uninitialised tensor of value v's shape with `n_rows` rows."""
        val = self.values[v]
        shape = [eval_dim(dim, n_rows) for dim in val.shape]
        return torch.empty(shape, dtype=getattr(torch, val.dtype), device=self.device)

    def stand_in(self, v: str, n_rows: int) -> torch.Tensor:
        """A tensor of value v's shape with `n_rows` rows and one element of storage, for a
        stage that reads v only for its sizes (`Routes.shape_only`)."""
        val = self.values[v]
        shape = [eval_dim(dim, n_rows) for dim in val.shape]
        return torch.zeros((), dtype=getattr(torch, val.dtype), device=self.device).expand(shape)

    def send_rows(self, x: torch.Tensor, key: Key, have: Range,
                  dests: Iterable[tuple[int, Range]]) -> None:
        """Send each (rank, rows) destination its part of x (value `key.value`'s rows `have`)."""
        for r, theirs in dests:
            part = intersect(have, theirs)
            if part is not None:
                self.send(self.row_slice(x, key.value, have, part), r, key)

    def recv_rows(self, key: Key, rows: Range, sources: Iterable[tuple[int, Range]]) -> torch.Tensor:
        """Value `key.value`'s rows `rows`, assembled from the pieces of (rank, rows) sources
        (the same as when `expect` posted them, if it did)."""
        posted = self._posted.pop(key, None)
        self._received.add(key)
        pieces = []
        for i, (r, have) in enumerate(_parts(rows, sources)):
            if r == self.rank:
                pieces.append(self._local.pop(key))  # sliced to `part` by the sender (this rank)
                continue
            if posted is not None:
                buf, work = posted[i]  # type: ignore[misc]
                work.wait()
            else:
                self.settle()
                buf = self.empty(key.value, have[1] - have[0])
                dist.recv(buf, r, tag=self.tags(key))
            pieces.append(buf)
            self._arrived(r, key)
        d = self.values[key.value].batch_dim or 0
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)

    def expect(self, key: Key, rows: Range, sources: Iterable[tuple[int, Range]],
               settle: bool = False) -> None:
        """Post now the receives of a `recv_rows(key, rows, sources)` to come in this call, so
        their data moves while this rank computes. Nothing on a guessed layout (the rows may
        change) unless `settle` (the receive is taken now: the layout is settled first, as
        `recv_rows` would), nothing twice: every key posted must be received in the same call
        (a receive left posted would take the next call's message; `check_drained`)."""
        if key in self._posted or key in self._received:
            return
        parts = _parts(rows, sources)
        if all(r == self.rank for r, _ in parts):
            return
        if self.guess is not None:
            if not settle:
                return
            self.settle()
        tag = self.tags(key)
        posted: list[tuple[torch.Tensor, Any] | None] = []
        for r, have in parts:
            if r == self.rank:
                posted.append(None)
            else:
                buf = self.empty(key.value, have[1] - have[0])
                posted.append((buf, dist.irecv(buf, r, tag=tag)))
        self._posted[key] = posted

    def check_drained(self) -> None:
        """Every receive posted ahead was received (an executor's bug otherwise: refused here
        rather than let the next call's message land in this call's buffer)."""
        if self._posted:
            raise RaNNCError(f"rannc internal error: receives posted and never taken: "
                             f"{sorted(map(str, self._posted))}")

    # -- one tensor ----------------------------------------------------------------------------
    def send(self, x: torch.Tensor, dst: int, key: Key) -> None:
        if dst == self.rank:
            self._local[key] = x.detach()
        elif self.guess is not None:
            self._held_back.append((x.detach().contiguous(), dst, key))
        else:
            self._isend(x.detach().contiguous(), dst, key)

    def _isend(self, x: torch.Tensor, dst: int, key: Key) -> None:
        self._sends.setdefault(dst, []).append((dist.isend(x, dst, tag=self.tags(key)), key))

    def _arrived(self, r: int, key: Key) -> None:
        """Message `key` came from rank r: drop the sends to r it proves arrived."""
        sends, arrivals = self._sends.get(r), self.arrivals
        if not sends or arrivals is None:
            return
        then = arrivals.sent(key)
        if then is None:  # (a message sent outside the lines proves nothing)
            return
        keep = []
        for work, k in sends:
            if arrivals.taken_before(k, then):
                work.wait()  # (returns at once: r has taken it)
            else:
                keep.append((work, k))
        self._sends[r] = keep

    def pending_sends(self) -> list[tuple[int, Key]]:
        """(destination, key) of the sends not yet waited for."""
        return [(r, k) for r, sends in self._sends.items() for _, k in sends]

    def wait_sends(self) -> None:
        for sends in self._sends.values():
            for w, _ in sends:
                w.wait()
        self._sends.clear()

    # -- a guessed layout ----------------------------------------------------------------------
    def poll(self) -> None:
        """Send what was held back if the agreement has arrived (never waits)."""
        if self.guess is not None and self.guess.agreement.ready():
            self.settle()

    def settle(self) -> None:
        """A call run on a guessed layout: wait for the ranks' agreement (raising what it raises,
        on every rank alike), then either send what was held back or, if some rank's batch size
        changed, raise LayoutChanged."""
        if self.guess is None:
            return
        sizes = self.guess.agreement.resolve()
        for check in self.guess.checks:
            check()
        if sizes != self.guess.sizes:
            raise LayoutChanged(sizes)
        self.guess = None
        for x, dst, key in self._held_back:
            self._isend(x, dst, key)
        self._held_back.clear()


def _parts(rows: Range, sources: Iterable[tuple[int, Range]]) -> list[tuple[int, Range]]:
    """(rank, rows) of each piece of `rows` that the (rank, rows held) sources supply."""
    out = []
    for r, have in sources:
        part = intersect(rows, have)
        if part is not None:
            out.append((r, part))
    return out


__all__ = ["MAX_TAG", "Channel", "Guess", "Key", "Kind", "LayoutChanged", "Tags", "Transport"]
