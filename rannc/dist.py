"""Process identity and the torch.distributed bootstrap under mpirun, torchrun or plain python.

Before a process group exists, :func:`get_rank`, :func:`get_world_size` and :func:`get_local_rank`
read the launcher's environment, so code that only needs to know "am I rank 0?" works without
any set-up.  :func:`init_process_group` then creates the default process group the same way under
every launcher, so the rest of rannc can use ``torch.distributed`` collectives uniformly:

* torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``): the
  ``env://`` rendezvous that torchrun prepared.
* mpirun / mpiexec (``PMI_RANK``+``PMI_SIZE`` from MPICH/Hydra, ``OMPI_COMM_WORLD_RANK`` from
  Open MPI, ``PMIX_RANK``): MPI launchers provide no rendezvous address, so rank 0 opens a TCP
  store and broadcasts its address with mpi4py.
* plain ``python``: a one-rank gloo group on an in-process store, so collectives are no-ops
  rather than errors.

The MPI rendezvous deliberately does not use ``init_method="tcp://addr:port"``: torch's store
server then listens on every interface (``*:port``) whatever ``addr`` says, and the port that rank
0 probed could be taken by another process before the store binds it.  Instead rank 0 binds a
listening socket to the chosen address (127.0.0.1 when all ranks share one node) and hands that
socket to :class:`torch.distributed.TCPStore` (``master_listen_fd``): the store listens only there,
and there is no window for the port to be stolen.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Launchers and the variables they set for the rank and the world size.
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
# ... and for the rank within the node (Hydra sets MPI_LOCALRANKID).
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

#: Environment variable forcing the backend: "gloo" (or "nccl"); unset/"auto" picks one.
BACKEND_ENV = "RANNC_BACKEND"
#: Environment variable naming the address rank 0 listens on for an MPI launch spanning nodes.
MASTER_ADDR_ENV = "RANNC_MASTER_ADDR"
#: Set to "0" to keep MPI's default when a rank dies of an exception (see _install_mpi_abort_on_error).
ABORT_ON_ERROR_ENV = "RANNC_MPI_ABORT_ON_ERROR"

LAUNCHER_TORCHRUN = "torchrun"
LAUNCHER_MPI = "mpi"
LAUNCHER_PYTHON = "python"
#: torch.distributed was initialized by someone else before :func:`init_process_group`.
LAUNCHER_EXTERNAL = "external"


@dataclass(frozen=True)
class DistContext:
    """What :func:`init_process_group` set up; frozen because every rank must agree on it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    launcher: str


_lock = threading.RLock()
_context: DistContext | None = None
_owned = False  # whether we created the default group (and so may destroy it)
_timeout = datetime.timedelta(seconds=300.0)
_groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}
_groups_of: object = None  # the default group `_groups` were made under (a new one: made anew)
_saved_gloo_ifname: tuple[bool, str | None] = (False, None)  # (we changed it, previous value)


def _from_env(names: tuple[str, ...], default: int) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return default


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank (0 in a plain `python` run)."""
    if _initialized():
        return dist.get_rank()
    return _from_env(_RANK_VARS, 0)


def get_world_size() -> int:
    """The number of ranks (1 in a plain `python` run)."""
    if _initialized():
        return dist.get_world_size()
    return _from_env(_SIZE_VARS, 1)


def get_local_rank() -> int:
    """This process's rank among the ranks on its node (it picks the GPU); 0 in a plain run."""
    ctx = _context
    if ctx is not None and _initialized():
        return ctx.local_rank
    return _from_env(_LOCAL_RANK_VARS, 0)


def barrier() -> None:
    """Wait for every rank (a no-op with one process or before :func:`init_process_group`)."""
    if not _initialized():
        return
    ctx = _context
    if ctx is not None and ctx.backend == "nccl" and ctx.device.type == "cuda":
        # Naming the device keeps NCCL from guessing it (and warning) for the barrier.
        dist.barrier(device_ids=[ctx.device.index if ctx.device.index is not None else 0])
    else:
        dist.barrier()


def detect_launcher() -> str:
    """Which launcher started this process, judged from its environment.

    torchrun is checked first because it sets a complete rendezvous (MASTER_ADDR/PORT); an MPI
    launcher only sets rank variables, and plain python sets none.
    """
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return LAUNCHER_TORCHRUN
    if ("PMI_RANK" in os.environ and "PMI_SIZE" in os.environ) or any(
        v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")
    ):
        return LAUNCHER_MPI
    return LAUNCHER_PYTHON


def init(timeout_s: float | None = None) -> DistContext | None:
    """Start the default process group now, as `RaNNCModule(...)` does at construction.

    Under mpiexec/mpirun or torchrun (more than one rank) this creates the group, so
    `torch.distributed` calls made before the first forward work (a `DistributedSampler(ds)`
    right after wrapping); returns its :class:`DistContext`. In a plain `python` run it does
    nothing and returns None unless `timeout_s` is given, in which case a one-rank gloo group is
    made (for code that needs one, e.g. a `DistributedSampler`). `timeout_s` defaults to the
    `timeout_s` of `rannc.Config()` (environment `RANNC_TIMEOUT_S`). Idempotent.
    """
    if get_world_size() <= 1 and timeout_s is None:
        return None
    if timeout_s is None:
        from rannc.config import Config

        timeout_s = Config.resolve(None).timeout_s
    return init_process_group(timeout_s)


def init_process_group(timeout_s: float = 300.0) -> DistContext:
    """Create the default torch.distributed group for whichever launcher started us.

    Idempotent: later calls return the same :class:`DistContext` (their ``timeout_s`` is ignored).
    If torch.distributed was already initialized by the caller, it is wrapped, not replaced, and
    :func:`shutdown` leaves it alone.  ``timeout_s`` bounds the rendezvous and every later
    collective, so a rank that dies turns into an error on the others instead of a hang.
    """
    global _context, _owned, _timeout
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    with _lock:
        if _context is not None:
            if _initialized():
                return _context
            # Someone destroyed the group behind our back: forget it and start over.
            _reset_state()
        timeout = datetime.timedelta(seconds=timeout_s)
        if _initialized():
            _context = _wrap_existing()
            _owned = False
            _timeout = timeout
            _at_exit_once()
            _start_watchdog(_context, timeout_s)
            return _context
        launcher = detect_launcher()
        try:
            if launcher == LAUNCHER_TORCHRUN:
                ctx = _init_torchrun(timeout)
            elif launcher == LAUNCHER_MPI:
                ctx = _init_mpi(timeout)
            else:
                ctx = _init_single(timeout)
        except BaseException:
            _reset_state()  # undo the GLOO_SOCKET_IFNAME pin of a half-done init
            raise
        _context, _owned, _timeout = ctx, True, timeout
        _at_exit_once()
        _start_watchdog(ctx, timeout_s)
        return ctx


def _start_watchdog(ctx: DistContext, timeout_s: float) -> None:
    """Every rank watches the others from here on (rannc.health): a failed or dead rank becomes a
    prompt, named error everywhere instead of a hang."""
    import logging

    from rannc import health

    try:
        health.start(ctx.rank, ctx.world_size, timeout_s,
                     hosts_store=ctx.launcher == LAUNCHER_MPI and ctx.rank == 0,
                     name_pids=ctx.launcher == LAUNCHER_MPI)
    except health.RankFailure:
        raise
    except Exception as e:  # e.g. a user-made group on a store without compare_set
        logging.getLogger("rannc").warning(
            "rannc: no failure watchdog (%s: %s); a failed rank will show as a collective "
            "timeout after %.0f s instead", type(e).__name__, e, timeout_s)


def new_group(ranks: Sequence[int], purpose: str = "") -> dist.ProcessGroup | None:
    """A process group over ``ranks``, created once and cached by ``purpose`` and its sorted rank
    tuple.

    Why cached: torch never frees a group (a gloo group holds a connection to each member and
    threads; an NCCL one a communicator and its buffers), and every runtime (one per input
    signature: each new sequence length of an unpadded batch, eval mode) needs groups over the
    same ranks; made per runtime they grew by a few with every capture, without bound. Why by
    purpose: the collectives of one group must be posted in the same order on every rank, and
    those of different purposes (gradient buckets started as backward finishes them, BatchNorm
    statistics, the default group's scalar sums) are not ordered against each other alike on
    every rank (an eager schedule's buckets and its loss's sum, say): each purpose keeps groups
    of its own, as each runtime had. Within one purpose the runtimes post in program order.

    torch requires *every* rank of the world -- members or not -- to call ``new_group`` for every
    group, in the same order (creating a group synchronizes over the default group's store);
    callers must therefore create groups in a deterministic order on all ranks, e.g. by
    iterating over the same list.  Returns None on ranks that are not members of the group.
    """
    with _lock:
        if not _initialized():
            raise RuntimeError(
                f"new_group({list(ranks)!r}) called before the default process group exists; "
                "call rannc.dist.init_process_group() first"
            )
        key = tuple(sorted(int(r) for r in ranks))
        world = dist.get_world_size()
        if not key:
            raise ValueError("new_group needs at least one rank, got an empty sequence")
        if len(set(key)) != len(key):
            raise ValueError(f"new_group ranks contain duplicates: {list(ranks)!r}")
        if key[0] < 0 or key[-1] >= world:
            raise ValueError(f"new_group ranks {list(key)!r} out of range for world size {world}")
        global _groups_of
        if _groups_of is not dist.group.WORLD:  # (the default group was destroyed and made anew)
            _groups.clear()
            _groups_of = dist.group.WORLD
        if (purpose, key) in _groups:
            return _groups[purpose, key]
        pg = dist.new_group(list(key), timeout=_timeout)
        # torch returns a sentinel (GroupMember.NON_GROUP_MEMBER) to non-members; say None.
        group: dist.ProcessGroup | None = pg if isinstance(pg, dist.ProcessGroup) else None
        _groups[purpose, key] = group
        return group


def shutdown() -> None:
    """Destroy the default group if :func:`init_process_group` created it, and forget the context.

    A group the caller initialized before us is left intact (only our wrapper is dropped), so the
    caller's own teardown still works.
    """
    global _owned
    with _lock:
        from rannc import health

        health.stop()
        if _owned and _initialized():
            dist.destroy_process_group()
        _owned = False
        _reset_state()


_exit_registered = False


def _at_exit_once() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_groups_at_exit)


def _groups_at_exit() -> None:
    """At a normal exit, destroy the process groups rannc made (the default group only where
    rannc created it: `shutdown`), while the interpreter still runs.

    Why: left to the interpreter's finalization, a gloo worker thread that frees its last
    collective's tensors after the main thread began finalizing needs the interpreter's lock,
    which a finalizing interpreter never gives back; the thread is ended by a forced unwind
    through a destructor and the process aborts with "terminate called without an active
    exception" (exit code 6; mpiexec reports a BAD TERMINATION) after the script finished: 1
    launch in 16 of a 2-rank job here. Destroying a group shuts its workers down and joins
    them without the lock. Skipped after an uncaught exception or a peer's failure: the abort
    handlers end such a process, and a group waiting for a dead peer's work must not hold it."""
    from rannc import health

    if _uncaught_exception or getattr(sys, "last_value", None) is not None or health.failing():
        return
    with contextlib.suppress(Exception):
        for group in list(_groups.values()):
            if group is not None and _initialized():
                dist.destroy_process_group(group)
        _groups.clear()
        if _owned:
            shutdown()


def _reset_state() -> None:
    global _context, _owned, _saved_gloo_ifname
    _context = None
    _owned = False
    _groups.clear()
    changed, previous = _saved_gloo_ifname
    if changed:
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous
    _saved_gloo_ifname = (False, None)


# --------------------------------------------------------------------------------------------
# Backend and device choice


def _choose_backend(local_world_size: int) -> str:
    """'nccl' when this node has a GPU for every local rank, else 'gloo'; RANNC_BACKEND overrides.

    NCCL needs one GPU per rank; sharing a GPU between ranks makes NCCL fail or deadlock, so
    with fewer GPUs than local ranks we fall back to gloo on the CPU.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if forced in ("", "auto"):
        return "nccl" if gpus >= local_world_size and gpus > 0 else "gloo"
    if forced == "gloo":
        return "gloo"
    if forced == "nccl":
        if gpus == 0:
            raise RuntimeError(
                f"{BACKEND_ENV}=nccl but torch {torch.__version__} sees no CUDA device "
                f"(torch.cuda.is_available()={torch.cuda.is_available()}); install a CUDA build of "
                f"torch on a GPU node, or set {BACKEND_ENV}=gloo (or unset it) to use the CPU"
            )
        if gpus < local_world_size:
            raise RuntimeError(
                f"{BACKEND_ENV}=nccl but this node has {gpus} CUDA device(s) for "
                f"{local_world_size} local ranks (NCCL needs one each); start at most {gpus} ranks "
                f"per node, or set {BACKEND_ENV}=gloo (or unset it) to use the CPU"
            )
        return "nccl"
    raise ValueError(f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r} is not one of 'auto', 'gloo', 'nccl'")


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        # Bind before init so NCCL and every later .cuda() use this rank's own GPU.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _pin_gloo_to_loopback(backend: str) -> None:
    """Make gloo's data sockets listen on loopback only, when every rank is on this node.

    Gloo otherwise binds to whatever the hostname resolves to, often a routable address, and its
    connections are unauthenticated.  A GLOO_SOCKET_IFNAME set by the user is respected.
    """
    global _saved_gloo_ifname
    if backend != "gloo" or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return
    for lo in ("lo", "lo0"):
        if lo in names:
            _saved_gloo_ifname = (True, None)
            os.environ["GLOO_SOCKET_IFNAME"] = lo
            return


# --------------------------------------------------------------------------------------------
# Launchers


def _wrap_existing() -> DistContext:
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device = torch.device("cpu")
    world = dist.get_world_size()
    return DistContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=_from_env(_LOCAL_RANK_VARS, 0),
        local_world_size=_from_env(("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS"), world),
        backend=backend,
        device=device,
        launcher=LAUNCHER_EXTERNAL,
    )


def _init_torchrun(timeout: datetime.timedelta) -> DistContext:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # torchrun always sets LOCAL_WORLD_SIZE; a hand-made env:// set-up may not, and then the
    # whole world is the conservative guess for how many GPUs this node needs.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = _choose_backend(local_world)
    device = _device_for(backend, local_rank)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store for the whole job and, since torch 2.x, no longer
        # prefixes it per restart: after `--max-restarts` brings the workers back, gloo's
        # rendezvous reads the dead attempt's addresses ("Gloo connectFullMesh failed ...
        # Connection refused") whenever it looks before the new peer has written its own. Every
        # attempt gets its own key space instead (the same prefix torch used to add).
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                               False, timeout)
        from rannc.health import attempt_prefix

        store = dist.PrefixStore(attempt_prefix(), client)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return DistContext(rank, world, local_rank, local_world, backend, device, LAUNCHER_TORCHRUN)


def _init_single(timeout: datetime.timedelta) -> DistContext:
    backend = _choose_backend(1)
    device = _device_for(backend, 0)
    _pin_gloo_to_loopback(backend)
    # An in-process store: one rank needs no network rendezvous at all.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(0, 1, 0, 1, backend, device, LAUNCHER_PYTHON)


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        env = {v: os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if v in os.environ}
        raise RuntimeError(
            f"started by an MPI launcher ({env}) but mpi4py cannot be imported into "
            f"{sys.executable} ({e}); install mpi4py (pip install mpi4py mpich), "
            "or launch with torchrun instead"
        ) from e
    return MPI


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _master_address(single_node: bool) -> str:
    """The address rank 0's store listens on: loopback on one node, else this host's address."""
    if single_node:
        return "127.0.0.1"
    override = os.environ.get(MASTER_ADDR_ENV)
    if override:
        return override
    host = socket.gethostname()
    candidates: list[str] = []
    try:
        candidates.append(socket.gethostbyname(host))
    except OSError:
        pass
    try:
        for *_, sockaddr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
            candidates.append(str(sockaddr[0]))
    except OSError:
        pass
    for addr in candidates:
        if not _is_loopback(addr):
            return addr
    raise RuntimeError(
        f"ranks span several nodes but hostname {host!r} resolves only to {sorted(set(candidates))} "
        f"(loopback or nothing), which other nodes cannot reach; set {MASTER_ADDR_ENV} to an "
        "address of rank 0's node that the other nodes can reach"
    )


def _listen(addr: str) -> socket.socket:
    """A listening TCP socket on ``addr`` with a free port picked by the kernel (port 0)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    return socket.create_server((addr, 0), family=family, backlog=1024)


_abort_hook_installed = False
_ABORT_GRACE_S = 0.5
_uncaught_exception = False


def _install_mpi_abort_on_error(MPI: Any) -> None:
    """Abort the whole MPI job when this rank dies of an uncaught exception.

    Without it one failing rank hangs the job: it reaches MPI_Finalize at interpreter exit
    (mpi4py calls it), which waits for every other rank, while those wait in a collective for
    the dead rank -- or, after their own collective timed out, in MPI_Finalize for a rank that is
    still computing.  ``python -m mpi4py`` does the same abort; set RANNC_MPI_ABORT_ON_ERROR=0 to
    keep MPI's default.

    The excepthook only records the failure (torch.distributed wraps sys.excepthook after us to
    prefix tracebacks with the rank, so the hook must not end the process mid-print); the abort
    happens in an atexit handler, which runs after the traceback was printed and before mpi4py's
    MPI_Finalize.  Exits through SystemExit with a non-zero code are not covered.
    """
    global _abort_hook_installed
    if _abort_hook_installed or os.environ.get(ABORT_ON_ERROR_ENV, "1").strip() == "0":
        return
    _abort_hook_installed = True
    previous = sys.excepthook

    def record_and_chain(
        exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None
    ) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        previous(exc_type, exc, tb)

    def abort_if_failed() -> None:
        if _uncaught_exception and MPI.Is_initialized() and not MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            # Hydra tears the job down on MPI_Abort without draining the ranks' output pipes;
            # without this pause the traceback explaining the failure is lost now and then.
            time.sleep(_ABORT_GRACE_S)
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = record_and_chain
    atexit.register(abort_if_failed)


def _init_mpi(timeout: datetime.timedelta) -> DistContext:
    MPI = _import_mpi()
    _install_mpi_abort_on_error(MPI)
    comm = MPI.COMM_WORLD
    rank, world = int(comm.Get_rank()), int(comm.Get_size())
    env_world = _from_env(_SIZE_VARS[1:], world)
    if env_world != world:
        # Classic mismatch: mpi4py linked against another MPI than the mpiexec used, so each
        # process initializes as a singleton world of 1.
        raise RuntimeError(
            f"the launcher says world size {env_world} but mpi4py's COMM_WORLD has {world} rank(s): "
            f"mpiexec and mpi4py come from different MPI installations; launch with the mpiexec "
            f"of the MPI mpi4py uses (e.g. {os.path.join(os.path.dirname(sys.executable), 'mpiexec')})"
        )
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_world = int(local.Get_rank()), int(local.Get_size())
    finally:
        local.Free()
    single_node = len(set(comm.allgather(MPI.Get_processor_name()))) == 1

    # Every rank must pick the same backend, or the group creation deadlocks: agree on the
    # weakest node's answer.
    try:
        backend: str | None = _choose_backend(local_world)
        choice_error = ""
    except (RuntimeError, ValueError) as e:
        backend, choice_error = None, str(e)
    codes = comm.allgather((backend, choice_error))
    errors = sorted({f"rank {r}: {err}" for r, (_, err) in enumerate(codes) if err})
    if errors:
        raise RuntimeError("backend choice failed: " + "; ".join(errors))
    backend = "gloo" if any(b == "gloo" for b, _ in codes) else "nccl"
    device = _device_for(backend, local_rank)
    if single_node:
        _pin_gloo_to_loopback(backend)

    # Rank 0 binds the store's socket and broadcasts where it is; a failure is broadcast too,
    # so the other ranks raise instead of waiting for a store that will never come.
    listener: socket.socket | None = None
    payload: tuple[str, int, str]
    if rank == 0:
        try:
            addr = _master_address(single_node)
            listener = _listen(addr)
            payload = (addr, int(listener.getsockname()[1]), "")
        except Exception as e:  # any failure must reach the other ranks, not only rank 0
            payload = ("", 0, f"{type(e).__name__}: {e}")
    else:
        payload = ("", 0, "")
    addr, port, error = comm.bcast(payload, root=0)
    if error:
        raise RuntimeError(f"rank 0 could not open the rendezvous socket: {error}")

    if listener is not None:
        # The store takes ownership of the descriptor (and closes it on destruction).
        store = dist.TCPStore(
            addr, port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
        )
    else:
        store = dist.TCPStore(addr, port, world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistContext(rank, world, local_rank, local_world, backend, device, LAUNCHER_MPI)
