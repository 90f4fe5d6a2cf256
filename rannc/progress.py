"""Progress bars for the slow part of the first call: capture, atomic components, profiling
and the stage DP search take from seconds to minutes on a large model, and a silent terminal
for that long looks like a hang.

One object: `phase(name, total)`, a context manager that yields a `step(n)` callable, and
`iterate(name, items)` for a loop. Planning code takes a `Progress` and defaults to
`NO_PROGRESS`, which draws nothing, so it stays pure and quiet in tests and for library
callers; only the facade (RaNNCModule's first call) and `rannc.plan` build a real one, with
`progress_for` (Config.progress):

* rank 0 only: every rank captures, but one set of bars is what a user reads;
* "auto" (the default): only when stderr is a terminal, so logs, CI output and files piped
  from `mpirun` stay free of carriage returns;
* "on" / "off": always / never (RANNC_PROGRESS=1 / 0 in the environment).

tqdm draws the bars (a rannc dependency; Hugging Face's libraries pull it in as well); it is
imported only when a bar is shown.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO, TypeVar

Step = Callable[[int], None]
T = TypeVar("T")


def _no_step(n: int = 1) -> None:
    return None


class Progress:
    """Draws nothing: the default of every planning function."""

    enabled = False

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[Step]:
        """Run one phase; the caller calls the yielded `step(n)` after n of `total` units."""
        yield _no_step

    def iterate(self, name: str, items: Sequence[T]) -> Iterator[T]:
        """`items`, one step of phase `name` each."""
        with self.phase(name, total=len(items)) as step:
            for x in items:
                yield x
                step(1)


NO_PROGRESS = Progress()


class _Bars(Progress):
    """One tqdm bar per phase on `stream`, left on screen when the phase ends (a log of how
    long each phase took) unless nested in another."""

    enabled = True

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[Step]:
        from tqdm import tqdm

        # A phase of unknown length (capture: one opaque call) shows its name and, once done,
        # its time; a counted one its bar and the expected remaining time.
        fmt = ("{desc}: {elapsed}" if total is None else
               "{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
        # leave=None: a phase's line stays, one nested in another's (profiling inside the
        # boundary refinement) is cleared when it ends.
        with tqdm(total=total, desc=f"rannc: {name}", file=self.stream, leave=None,
                  bar_format=fmt, dynamic_ncols=True, mininterval=0.2) as bar:
            yield bar.update


def progress_for(setting: bool | str, rank: int, stream: TextIO | None = None) -> Progress:
    """The progress to show for Config.progress `setting` ("auto", "on"/True or "off"/False)
    on `rank`: bars on rank 0 only, and under "auto" only when `stream` (default stderr) is a
    terminal."""
    out = sys.stderr if stream is None else stream
    if rank != 0 or setting in (False, "off"):
        return NO_PROGRESS
    if setting == "auto" and not _is_tty(out):
        return NO_PROGRESS
    return _Bars(out)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: treat as a file
        return False


__all__ = ["NO_PROGRESS", "Progress", "Step", "progress_for"]
