"""Turning a failed, dead or stuck rank into a prompt error that names it, on every rank.

Without help a distributed job fails badly: one rank raises, and the others wait in a collective
for it until the backend's timeout (or forever, in MPI_Finalize); one rank is killed, and the
others report "Connection closed by peer" without saying who or when.  Each rank therefore runs
a watchdog thread that talks to the rendezvous store (the TCPStore every launcher already has):

* it publishes this rank's *beat*: the step (the count of ``forward()`` calls), the phase
  (forward, backward, gradient all-reduce, checkpoint write, ...), the pid and the host;
* a rank whose code raises posts the first *failure* record (rank, step, phase, error) -- from
  the phase that raised, or from ``sys.excepthook`` for an error outside rannc's calls;
* every other rank's watchdog sees the record within ``POLL_S``, prints one line naming the failed
  rank, its step and phase and the error, and ends its own process with exit status 1 -- its
  main thread is stuck in a collective that will never complete, so it cannot raise there;
* a peer on the same host whose process is gone (killed, crashed in C++, ``os._exit``) is noticed
  by its pid and named the same way, with the step and phase of its last beat;
* a collective that times out (``timeout_s``) or breaks is re-raised as :class:`RankFailure`
  saying where every rank was, so "backward() called on some ranks only" reads as such; when
  some ranks are behind (an earlier step, or in their own code), the time-out blames them, not
  the rank that waited: "rank 1 did not arrive ... (rank 1: after backward of step 4, in user
  code for 21 s)", with the ``timeout_s`` to raise if that is expected (each beat carries
  when its phase began).

Under mpiexec, Hydra kills every rank with SIGKILL the moment one rank dies, before anyone can
speak; rank 0 therefore logs which pid each rank is, so Hydra's "BAD TERMINATION ... PID n" can
be traced to a rank.  Under torchrun the agent stops the others with SIGTERM, which the
watchdog turns into the same named message; a SIGTERM with no failure before it (a user's
``kill``, a job scheduler) is said to be just that, and posted for the other ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from rannc.errors import RankFailure, RaNNCError

#: How often the watchdog beats and looks for failures (seconds).
POLL_S = 0.2
#: How long a failing rank waits for the others to print their message before it exits.
ACK_WAIT_S = 3.0
#: How long a closing rank waits for its watchdog thread to leave its store call (seconds).
JOIN_S = 5.0
_PREFIX = "rannc/health/"
EXITED = "exited"


class Health:
    """This rank's watchdog (see the module docstring); one per process, made by :func:`start`."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float) -> None:
        self.store = store
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.step = 0
        self.phase = "start-up"
        self.since = time.time()  # when this rank entered its phase (wall clock, for peers)
        self.failing = False  # this rank has failed (posted or about to): ignore the others'
        self.peers: dict[int, dict[str, Any]] = {}
        self._stack: list[str] = []
        self._exited: set[int] = set()
        self.closed = False
        self.hosts_store = False
        self._published: tuple[int, str] | None = None
        self._host = socket.gethostname()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # the main thread's "publish now" (`phase_of`), answered by the watchdog thread
        self._nudge_r, self._nudge_w = os.pipe()
        os.set_blocking(self._nudge_w, False)
        os.set_blocking(self._nudge_r, False)
        self._thread = threading.Thread(target=self._loop, name="rannc-watchdog", daemon=True)

    # -- main thread ------------------------------------------------------------------------
    def begin(self) -> None:
        """Publish the first beat, learn every peer's pid and host, and start watching."""
        self._beat(force=True)
        deadline = time.monotonic() + self.timeout_s
        for r in range(self.world):
            key = f"beat/{r}"
            while not self.store.check([key]):
                if time.monotonic() > deadline:
                    raise RankFailure(f"rank {r} never reported to the rendezvous store within "
                                      f"{self.timeout_s:.0f} s (timeout_s); did it start?")
                time.sleep(0.01)
            self.peers[r] = json.loads(self.store.get(key))
        self._thread.start()

    @contextlib.contextmanager
    def phase_of(self, phase: str, step: int | None = None) -> Iterator[None]:
        """Run a part of a step under `phase`: it is published, and an error inside it is posted
        (unless every rank raises it alike) or, for a broken collective, explained."""
        self._stack.append(phase)
        self.phase = phase
        self.since = time.time()
        if step is not None:
            self.step = step
            # Once per step: the watchdog publishes phase changes only every POLL_S, and a fast
            # step could otherwise be missed entirely. Its thread makes the store round trip,
            # not this one: measured on 4 CPU ranks, the round trip took 0.08 ms typically but
            # up to 20 ms while rank 0 (the store's host) waited for a core, and every rank
            # waits for the slowest in the step's collectives.
            with contextlib.suppress(OSError):  # (a full pipe: a nudge is already pending)
                os.write(self._nudge_w, b"s")
        try:
            yield
        except RaNNCError:
            raise  # rannc's own errors are raised on every rank alike: nobody is left waiting
        except Exception as e:
            if _is_comm_error(e):
                late = self._late_peers()
                if late:
                    # The collective timed out because these ranks never came: blame them, not
                    # this rank (which only waited), and say where they were.
                    err = RankFailure(self._late_text(late, phase) +
                                      f" ({type(e).__name__}: {_first_line(e)})")
                    self.post(f"{type(err).__name__}: {err}", blame=sorted(late))
                    raise err from e
                err = RankFailure(
                    f"rank {self.rank}: the {phase} of step {self.step} failed in a collective "
                    f"({type(e).__name__}: {_first_line(e)}). {self.explain()}")
                self.post(f"{type(err).__name__}: {err}")
                raise err from e
            self.post(f"{type(e).__name__}: {_first_line(e)}")
            raise
        finally:
            self._stack.pop()
        self.phase = self._stack[-1] if self._stack else f"after {phase}"
        self.since = time.time()

    def _late_peers(self) -> dict[int, tuple[int, str, float]]:
        """The ranks behind this one by their last beat, in their own code (after an earlier
        step, or before this step's call), with (step, phase, seconds in that phase)."""
        late = {}
        now = time.time()
        for r in range(self.world):
            if r == self.rank:
                continue
            with contextlib.suppress(Exception):
                b = json.loads(self.store.get(f"beat/{r}"))
                step, phase = int(b["step"]), str(b["phase"])
                # Only a rank in its own code is late: one inside another rannc call (backward
                # while this rank is in forward) diverged, which explain() describes.
                behind = _in_user_code(phase) and (step < self.step or (
                    step == self.step and not _in_user_code(self.phase)))
                if behind and phase != EXITED:
                    late[r] = (step, phase, now - float(b.get("since", now)))
        return late

    def _late_text(self, late: dict[int, tuple[int, str, float]], phase: str) -> str:
        who = ", ".join(map(str, sorted(late)))
        where = "; ".join(
            f"rank {r}: {ph} of step {st}, in user code for {secs:.0f} s"
            for r, (st, ph, secs) in sorted(late.items()))
        return (f"rank{'s' if len(late) > 1 else ''} {who} did not arrive within timeout_s="
                f"{self.timeout_s:g} s: rank {self.rank} waited for {'them' if len(late) > 1 else 'it'} "
                f"in the {phase} of step {self.step} ({where}). If that is expected (slow data "
                "loading, evaluation or logging on some ranks), raise timeout_s "
                "(RaNNCModule(..., timeout_s=...) or RANNC_TIMEOUT_S); otherwise every rank must "
                "make the same calls: forward() and backward() on every rank, the same number "
                "of times")

    def post(self, error: str, blame: list[int] | None = None) -> None:
        """Record this rank's failure for the others (the first record wins) and give their
        watchdogs a moment to print it before this process goes on to exit. `blame`: the
        ranks that caused it (a time-out waiting for them), when not this one."""
        if self.failing:
            return
        self.failing = True
        record = json.dumps({"rank": self.rank, "step": self.step, "phase": self.phase,
                             "error": error[:2000], "blame": blame or []})
        with contextlib.suppress(Exception):  # the store may be gone with rank 0
            self.store.compare_set("failed", "", record)
            self.store.add("failing", 1)
            sys.stderr.write(f"[rannc] {_failed(json.loads(record))}\n")
            sys.stderr.flush()
            deadline = time.monotonic() + ACK_WAIT_S
            while time.monotonic() < deadline:
                # Every other rank has printed the failure, or failed itself.
                if self.store.add("acks", 0) + self.store.add("failing", 0) >= self.world:
                    break
                time.sleep(0.02)

    def explain(self) -> str:
        """Where every rank is, by its last beat: the diagnosis of a stuck collective."""
        parts = []
        # A broken connection can arrive before the peer's failure record, or before its process
        # is gone from the process table: give either a moment to show.
        deadline = time.monotonic() + 1.0
        failed, dead = self._failure(), self._dead_peers()
        while failed is None and not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            failed, dead = self._failure(), self._dead_peers()
        if failed is not None:
            text = _failed(failed)
            parts.append(text[0].upper() + text[1:] + ".")
        for r in dead:
            parts.append(self._died(r) + ".")
        where = {r: (self.step, self.phase) if r == self.rank else self._last(r)
                 for r in range(self.world)}
        known = {r: w for r, w in where.items() if w is not None}
        if known:
            parts.append("Last reported: " + "; ".join(
                f"rank {r}: step {step} ({phase})" for r, (step, phase) in known.items()) + ".")
        if failed is None and not dead and len(set(known.values())) > 1:
            parts.append("The ranks are at different points: every rank must make the same calls "
                         "in the same order -- forward() on every rank, and backward() on every "
                         "rank or on none (a loss that is not back-propagated everywhere).")
        return " ".join(parts) or "No rank reported a failure."

    # -- watchdog thread --------------------------------------------------------------------
    def _beat(self, force: bool = False) -> None:
        now = (self.step, self.phase)
        if force or now != self._published:
            self.store.set(f"beat/{self.rank}", json.dumps(
                {"step": self.step, "phase": self.phase, "pid": os.getpid(), "host": self._host,
                 "since": self.since}))
            self._published = now

    def _failure(self) -> dict[str, Any] | None:
        if not self.store.check(["failed"]):
            return None
        text = self.store.get("failed")
        return json.loads(text) if text else None

    def gone_past(self, r: int) -> bool:
        """Whether rank r has certainly gone on past this rank's present step: it finished its
        script, reached a later step, or died (a collective this rank is about to start would
        wait for it in vain)."""
        last = self._last(r)
        if last is not None and (last[1] == EXITED or last[0] > self.step):
            return True
        return r in self._dead_peers()

    def _dead_peers(self) -> list[int]:
        dead = []
        for r, info in self.peers.items():
            if r in self._exited or r == self.rank or info.get("host") != self._host \
                    or _alive(int(info["pid"])):
                continue
            last = self._last(r)
            if last is not None and last[1] == EXITED:  # it finished its script: not a failure
                self._exited.add(r)
                continue
            dead.append(r)
        return dead

    def close(self) -> None:
        """At this process's normal exit: stop watching and tell the others this rank is done
        (so its vanished pid is not taken for a death). The rank hosting the store (rank 0 under
        mpiexec) then waits for the others to finish, or it would take the store down under them."""
        if self.closed:
            return
        self.closed = True
        self._join_thread()
        if self.failing:
            return
        with contextlib.suppress(Exception):
            self.phase = EXITED
            self._beat(force=True)
            self.store.add("exited", 1)
            if self.hosts_store:
                deadline = time.monotonic() + self.timeout_s
                while time.monotonic() < deadline and not self._dead_peers():
                    if self.store.add("exited", 0) + self.store.add("failing", 0) >= self.world:
                        break
                    time.sleep(0.05)

    def _join_thread(self) -> None:
        """Wake the watchdog thread (it returns on seeing `closed`) and wait for it. Left
        running, a daemon thread can be inside a store call (native code, the interpreter's
        lock released) when the interpreter finalises: on taking the lock back it is ended by
        a forced unwind through a destructor, and the process aborts with "terminate called
        without an active exception" after the script finished. Joining also keeps the two
        threads off the store connection at once while `close` writes the last beat."""
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            return
        with contextlib.suppress(OSError):
            os.write(self._nudge_w, b"x")
        # a store call answers within milliseconds while the store lives; one blocked on a
        # store that is gone is left behind (that exit is an error already)
        self._thread.join(timeout=JOIN_S)

    def _died(self, r: int) -> str:
        last = self._last(r)
        at = f"step {last[0]} ({last[1]})" if last is not None else "an unknown step"
        return (f"rank {r} (pid {self.peers[r]['pid']}) died at {at} without reporting "
                "an error (killed, out of memory, or a crash in native code)")

    def _last(self, r: int) -> tuple[int, str] | None:
        """Rank r's last published (step, phase), None if it cannot be read."""
        with contextlib.suppress(Exception):
            if self.store.check([f"beat/{r}"]):
                b = json.loads(self.store.get(f"beat/{r}"))
                return int(b["step"]), str(b["phase"])
        return None

    def _loop(self) -> None:
        while True:
            ready, _, _ = select.select([self._wake_r, self._nudge_r], [], [], POLL_S)
            signalled = self._wake_r in ready
            if signalled:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
            if self._nudge_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._nudge_r, 4096)
            if self.failing or self.closed:
                return
            try:
                self._beat()
                failed = self._failure()
                if failed is not None and failed["rank"] != self.rank:
                    self._stop(_failed(failed), ack=True)
                dead = self._dead_peers()
                if dead:
                    self._stop("; ".join(self._died(r) for r in dead))
            except Exception as e:  # the store itself is gone: it lives on rank 0 (or the agent)
                if self.failing or self.closed:
                    return
                self._stop(f"the rendezvous store is unreachable ({type(e).__name__}: {e}); "
                           "rank 0 (which hosts it under mpiexec) or the launcher has gone")
            if signalled:
                self._terminated()

    def _terminated(self) -> None:
        """SIGTERM reached this process: from the launcher stopping the job after another rank
        failed (then that rank's record is there), or from a user's or scheduler's kill."""
        failed = self._failure()
        if failed is not None and failed["rank"] != self.rank:
            self._stop(f"this process was terminated by a signal (SIGTERM) after {_failed(failed)}",
                       ack=True)
        why = ("terminated by a signal (SIGTERM, from a kill, the launcher or a job scheduler), "
               "not by an error in this rank's code")
        with contextlib.suppress(Exception):  # tell the others who stopped and why
            self.store.compare_set("failed", "", json.dumps(
                {"rank": self.rank, "step": self.step, "phase": self.phase, "error": why}))
            self.store.add("failing", 1)
        self._stop(f"this process was {why}")

    def _stop(self, why: str, ack: bool = False) -> None:
        sys.stderr.write(f"[rannc] rank {self.rank} stops at step {self.step} ({self.phase}): "
                         f"{why}\n")
        sys.stderr.flush()
        if ack:
            with contextlib.suppress(Exception):
                self.store.add("acks", 1)
        os._exit(1)


_health: Health | None = None


def current() -> Health | None:
    """This process's watchdog, or None in a one-rank run."""
    return _health


@contextlib.contextmanager
def phase(name: str, step: int | None = None) -> Iterator[None]:
    """`Health.phase_of` on this process's watchdog; nothing in a one-rank run."""
    h = _health
    if h is None:
        yield
        return
    with h.phase_of(name, step):
        yield


def failing() -> bool:
    """Whether this rank has failed (its failure posted or about to be)."""
    return _health is not None and _health.failing


def stop() -> None:
    """Stop watching (before the process group is destroyed on purpose)."""
    global _health
    if _health is not None:
        _health.close()
        _health = None


def attempt_prefix() -> str:
    """The key space of this run of the workers in a store that outlives it (torchrun's agent
    store survives a `--max-restarts` restart): ``rannc/attempt_N/`` with torchrun's restart
    count N, ``rannc/attempt_0/`` under other launchers. Everything rannc keeps in a store lives
    under it, so an attempt never reads what a dead one left (peers' addresses, a failure record)."""
    return f"rannc/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def start(rank: int, world: int, timeout_s: float, *, hosts_store: bool = False,
          name_pids: bool = False, store: Any | None = None) -> Health | None:
    """Start the watchdog of a multi-rank job (called once the default group exists).

    `hosts_store`: this process runs the store's server (rank 0 under mpiexec), so it stays until
    the others are done. `name_pids`: rank 0 prints which pid each rank is (for mpiexec, whose
    Hydra names only the pid of a rank that died)."""
    global _health
    if _health is not None or world < 2:
        return _health
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    clone = getattr(store, "clone", None)
    if clone is not None:
        with contextlib.suppress(Exception):  # its own connection: the main thread uses it too
            store = clone()
    # Unwrapped down to the launcher's store, so the attempt's key space is put back: under
    # torchrun a restarted attempt must not read the failure record of the one before.
    h = Health(dist.PrefixStore(attempt_prefix() + _PREFIX, store), rank, world, timeout_s)
    h.hosts_store = hosts_store
    h.begin()
    _health = h
    _install_hooks(h)
    atexit.register(h.close)
    if rank == 0 and name_pids:
        sys.stderr.write("[rannc] ranks and pids: " + ", ".join(
            f"rank {r} pid {p['pid']} on {p['host']}" for r, p in sorted(h.peers.items())) + "\n")
        sys.stderr.flush()
    return h


def _install_hooks(h: Health) -> None:
    previous = sys.excepthook

    def post_and_chain(exc_type: type[BaseException], exc: BaseException,
                       tb: types.TracebackType | None) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            h.post(f"{exc_type.__name__}: {_first_line(exc)}")
        previous(exc_type, exc, tb)

    sys.excepthook = post_and_chain
    # SIGTERM (torchrun's agent stopping the workers) wakes the watchdog even while the main
    # thread waits in native code, where a Python-level handler would not run.
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(h._wake_w, warn_on_full_buffer=False)
            signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    # Reached only when the main thread is in Python; the watchdog usually speaks first.
    time.sleep(2 * POLL_S)
    os._exit(128 + signum)


def _in_user_code(phase: str) -> bool:
    """Whether a rank in `phase` is outside rannc's calls (between them, or before the first)."""
    return phase.startswith("after ") or phase == "start-up"


def _failed(record: dict[str, Any]) -> str:
    """A failure record as every message gives it."""
    if record.get("blame"):  # a time-out: the record's text already names the late ranks
        return str(record["error"]).removeprefix("RankFailure: ")
    return (f"rank {record['rank']} failed at step {record['step']} ({record['phase']}): "
            f"{record['error']}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by the launcher) is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("Timed out", "timed out", "Connection closed", "Connection reset",
                            "gloo", "Gloo", "NCCL", "Broken pipe"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else repr(e)
