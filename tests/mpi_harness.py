"""Run a script on several ranks (mpiexec or torchrun) from a pytest test, without ever hanging.

Every process of a launch carries a unique environment tag, so a timeout kills mpiexec, its
Hydra proxy and every rank (each in a session of its own), and the test fails with the tail of
what they printed instead of leaving orphans behind.  The environment is made reproducible:
the repository root and ``tests/`` on PYTHONPATH, one OpenMP thread per rank (the ranks share a
small machine), gloo as the backend, and no launcher variables inherited from an outer launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TAIL_CHARS = 4000
_TOKEN_VAR = "_RANNC_TEST_LAUNCH"  # tags every process of one launch (see run_command)

# Variables by which an outer launcher (pytest itself run under mpiexec/torchrun/Slurm) would
# make the inner ranks believe they belong to the outer job.
_LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMI_ID",
    "PMIX_RANK", "PMI_HOSTNAME", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
)  # fmt: skip

# MPICH (Hydra) findings in this container (running as root, gVisor, MPICH 5.0 wheel):
# * Root needs no flag (unlike Open MPI's --allow-run-as-root), and no ssh is used for the
#   local host even though the proxy is started with "--launcher ssh".
# * HYDRA_LAUNCHER=fork is therefore defensive only: it keeps Hydra from trying ssh if it does
#   not recognize the host name as local (containers with odd hostnames, no sshd).  Verified to
#   work identically here.
# * HYDRA_HOST_FILE from the outer environment is dropped: it would send ranks to other hosts.
# * Hydra's proxy and every rank call setsid(), so killing mpiexec's process group leaves them
#   running -- see run_command for how they are found and killed.
# * A rank that exits non-zero *before* MPI_Init does not end the job: the others wait in
#   MPI_Init forever.  Only the timeout here ends such a launch.
MPICH_ENV = {"HYDRA_LAUNCHER": "fork"}


def _find_tool(name: str) -> str | None:
    """``name`` next to the running interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def find_mpiexec() -> str | None:
    """The mpiexec to use: the venv's (it matches the MPI mpi4py was built for), else PATH's."""
    return _find_tool("mpiexec")


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    paths = [str(ROOT), str(TESTS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    env["RANNC_BACKEND"] = "gloo"
    env["PYTHONUNBUFFERED"] = "1"  # so a killed rank's last lines still reach the report
    if extra:
        env.update(extra)
    return env


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def _describe(cmd: Sequence[str], rc: int | None, out: str, err: str) -> str:
    return (
        f"command: {' '.join(cmd)}\nreturn code: {rc}\n"
        f"--- stdout (tail) ---\n{_tail(out)}\n--- stderr (tail) ---\n{_tail(err)}"
    )


def run_command(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on timeout kill it and every process it started, and fail the test.

    Every process of the launch is tagged with a unique environment variable, because a process
    group is not enough: Hydra's proxy and each rank call setsid(), so they are in sessions of
    their own, and they outlive mpiexec when it is killed.  The tag finds them wherever they are.
    """
    _check_layer(cmd)
    token = uuid.uuid4().hex
    proc = subprocess.Popen(
        list(cmd),
        cwd=str(ROOT),
        env={**env, _TOKEN_VAR: token},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    leftovers: list[int] = []
    try:
        out, err = proc.communicate(timeout=timeout)
        # Ranks still alive once the launcher returned (the fault tests assert there are none).
        leftovers = _tagged_pids(token)
        if leftovers:  # give processes that are on their way out a moment
            time.sleep(1.0)
            leftovers = _tagged_pids(token)
    except subprocess.TimeoutExpired:
        kill_launch(proc, token)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a descendant the tag did not reach holds a pipe
            out, err = "", "(output unavailable: a descendant kept the pipes open)"
        why = f"timed out after {timeout:.0f}s, all its processes killed\n"
        pytest.fail(why + _describe(cmd, None, out, err))
    finally:
        # Also on success: ranks that outlived the launcher would hold ports and CPU.
        kill_launch(proc, token)
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    result.leftovers = leftovers  # type: ignore[attr-defined]
    if check and proc.returncode != 0:
        pytest.fail(f"exit status {proc.returncode}\n" + _describe(cmd, proc.returncode, out, err))
    return result


def _check_layer(cmd: Sequence[str]) -> None:
    """A launch of ranks belongs to a multi_rank test (the layers: tests/conftest.py)."""
    layer = os.environ.get("PYTEST_LAYER", "")
    launcher = any(Path(c).name in ("mpiexec", "mpirun", "torchrun") or c == "torch.distributed.run"
                   for c in cmd)
    if launcher and layer not in ("", "multi_rank"):
        pytest.fail(f"this test is marked {layer} but launches ranks ({Path(cmd[0]).name}): mark it "
                    "multi_rank (tests/conftest.py)", pytrace=False)


def _tagged_pids(token: str) -> list[int]:
    """Processes whose environment carries this launch's tag (Linux /proc; else none found)."""
    needle = f"{_TOKEN_VAR}={token}".encode()
    me = os.getpid()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(entry.name)
            if pid != me and needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(pid)
        except (OSError, ValueError):
            continue
    return pids


def kill_launch(proc: subprocess.Popen[str], token: str) -> None:
    """SIGKILL the launcher's process group and every process tagged with ``token``."""
    own_group = os.getpgrp()
    for _ in range(3):  # a process may fork while we kill; a few rounds catch its children
        victims = _tagged_pids(token)
        if proc.poll() is None:
            victims.append(proc.pid)
        if not victims:
            break
        for pid in victims:
            try:
                pgid = os.getpgid(pid)
                if pgid != own_group:  # never the group pytest itself runs in
                    os.killpg(pgid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    if proc.poll() is None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_mpi(
    script: str | Path,
    n: int,
    args: Sequence[str] = (),
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n n python script args``; skips the test when there is no mpiexec or mpi4py."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip(f"no mpiexec next to {sys.executable} or on PATH (pip install mpi4py mpich)")
    try:
        import mpi4py  # noqa: F401  (only whether it is installed; MPI itself is not initialized)
    except ImportError:
        pytest.skip(f"mpi4py is not installed for {sys.executable} (pip install mpi4py mpich)")
    full_env = _env({**MPICH_ENV, **(env or {})})
    full_env.pop("HYDRA_HOST_FILE", None)
    cmd = [mpiexec, "-n", str(n), sys.executable, str(script), *map(str, args)]
    return run_command(cmd, timeout, full_env, check)


def run_torchrun(
    script: str | Path,
    n: int,
    args: Sequence[str] = (),
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    launcher_args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node n [launcher_args] script args`` (the venv's,
    else ``-m``)."""
    torchrun = _find_tool("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", f"--nproc-per-node={n}", *launcher_args, str(script),
           *map(str, args)]
    return run_command(cmd, timeout, _env(env), check)


def run_python(
    script: str | Path,
    args: Sequence[str] = (),
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Plain ``python script args`` (world size 1), with the same environment and timeout."""
    cmd = [sys.executable, str(script), *map(str, args)]
    return run_command(cmd, timeout, _env(env), check)


CASE_RUNNER = TESTS / "scripts" / "case_batch.py"


@dataclass(frozen=True)
class Case:
    """One run of a check script of tests/scripts (a module with `parse` and `run`, which
    tests/scripts/case_batch.py calls): its ranks, its arguments (or a function of the launch's
    folder that writes the files the case reads and returns them), the environment variables
    it sets, the script (default: the CaseLaunches' script) and a group: only cases with the
    same ranks and group share a launch (a resume that must run in new processes: another
    group than the save before it)."""

    ranks: int
    args: Sequence[str] | Callable[[Path], Sequence[str]]
    env: Mapping[str, str] = field(default_factory=dict)
    script: str = ""
    group: str = ""


class CaseLaunches:
    """The cases of one test module, one mpiexec launch of tests/scripts/case_batch.py per
    rank count and group (per `chunk` cases of it), run when a test first asks for one of them
    (each case within `per_case_s` on every rank, else it fails and the launch ends).

    `wanted` are the case ids the selected tests use (`cases_of_items`); a launch runs those of
    its rank count and group, in the order of `cases`. A test gets its own case's output (each
    rank's, concatenated), as if its case had been launched alone; a case that did not finish
    on every rank fails its test with its ranks' output and the launch's. A case that kills the
    launch is recorded and the launch goes on, relaunched, with the cases after it."""

    def __init__(self, script: str | Path, cases: Mapping[str, Case], wanted: Sequence[str],
                 folder: Path, per_case_s: float = 150, chunk: int = 8) -> None:
        self.script, self.cases, self.folder = Path(script).stem, cases, folder
        self.per_case_s, self.chunk = per_case_s, chunk
        self.wanted = [c for c in cases if c in set(wanted)]
        self.results: dict[str, subprocess.CompletedProcess[str] | str] = {}

    def result(self, case_id: str) -> subprocess.CompletedProcess[str]:
        """The case's output (returncode 0); fails the test if the case did not finish."""
        if case_id not in self.results:
            key = (self.cases[case_id].ranks, self.cases[case_id].group)
            group = [c for c in self.wanted if (self.cases[c].ranks, self.cases[c].group) == key]
            if case_id not in group:
                group = [case_id]
            k = group.index(case_id) // self.chunk * self.chunk
            self._launch(group[k:k + self.chunk])
        got = self.results.get(case_id, f"case {case_id} was not run")
        if isinstance(got, str):
            pytest.fail(got, pytrace=False)
        return got

    def _launch(self, todo: list[str]) -> None:
        while todo:
            folder = new_launch_folder(self.folder)
            spec = []
            for c in list(todo):
                try:
                    spec.append({"id": c, "script": self.cases[c].script or self.script,
                                 "args": self._args(c, folder), "env": dict(self.cases[c].env)})
                except Exception:  # noqa: BLE001 - that case's test reports it, the others run
                    self.results[c] = f"the case's arguments could not be made:\n{traceback.format_exc()}"
                    todo.remove(c)
            if not todo:
                return
            ended = launch_cases(self.cases[todo[0]].ranks, spec, folder, 120 + self.per_case_s * len(todo),
                                 self.per_case_s)
            for c, case in zip(todo, ended.cases, strict=False):
                self.results[c] = case
            if len(ended.cases) == len(todo):
                if ended.returncode != 0:  # every case finished, the launch did not
                    for c in todo:
                        self.results[c] = f"the launch failed after its cases ended\n{ended.launch}"
                return
            self.results[todo[len(ended.cases)]] = ended.unfinished(todo[len(ended.cases)])
            todo = todo[len(ended.cases) + 1:]

    def _args(self, case_id: str, folder: Path) -> list[str]:
        args = self.cases[case_id].args
        return [str(a) for a in (args(folder) if callable(args) else args)]


@dataclass
class Ended:
    """What one launch of tests/scripts/case_batch.py left: the output of the cases that ended
    on every rank (a prefix of the launch's cases), of the first that did not (`stopped`, empty
    when all ended), the launch's own output and exit status (None: killed at its limit)."""

    cases: list[subprocess.CompletedProcess[str]]
    stopped: tuple[str, str]
    launch: str
    returncode: int | None

    def unfinished(self, name: str) -> str:
        """A failure message for the case that did not end on every rank."""
        out, err = self.stopped
        return (f"case {name} did not finish on every rank\n--- its stdout ---\n{_tail(out)}\n"
                f"--- its stderr ---\n{_tail(err)}\n--- the launch ---\n{self.launch}")


def new_launch_folder(parent: Path) -> Path:
    folder = parent / f"launch{len(list(parent.glob('launch*')))}"
    folder.mkdir(parents=True)
    return folder


def run_rannc_check(*args: str, timeout: float = 300) -> tuple[int, str]:
    """`python -m rannc.check ARGS` (it launches its own ranks), with the repository and tests/
    importable (factories such as conformance.zoo:llama); its exit status and output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
           "OMP_NUM_THREADS": "1"}
    res = run_command([sys.executable, "-m", "rannc.check", *args], timeout, env, check=False)
    return res.returncode, res.stdout + res.stderr


def launch_cases(n: int, spec: list[dict[str, Any]], folder: Path, timeout: float,
                 case_limit_s: float | None = None, env: Mapping[str, str] | None = None) -> Ended:
    """One mpiexec launch of tests/scripts/case_batch.py on `n` ranks running the cases of
    `spec` (each {"id", "script", "args", "env"}), its files in `folder`; a rank still in one
    case after `case_limit_s` ends the launch (a hung case costs its own limit, not the
    launch's). `env`: the launch's own environment variables (what a case's "env" cannot
    set: those read at interpreter start, as PYTHONHASHSEED)."""
    (folder / "cases.json").write_text(json.dumps({"out_dir": str(folder), "case_limit_s": case_limit_s,
                                                   "cases": spec}))
    try:
        res = run_mpi(CASE_RUNNER, n, [str(folder / "cases.json")], timeout=timeout, env=env,
                      check=False)
        launch, rc = _describe(res.args, res.returncode, res.stdout, res.stderr), res.returncode
    except pytest.fail.Exception as e:  # timed out: the cases that ended still count
        launch, rc = str(e), None
    # A case ended on a rank when that rank wrote its .done file (tests/scripts/case_batch.py).
    stop = next((k for k in range(len(spec))
                 if not all((folder / f"case{k}.rank{r}.done").exists() for r in range(n))), len(spec))
    ended = [subprocess.CompletedProcess([str(CASE_RUNNER), spec[k]["id"]], 0, *_case_output(folder, k, n))
             for k in range(stop)]
    stopped = _case_output(folder, stop, n) if stop < len(spec) else ("", "")
    return Ended(ended, stopped, launch, rc)


def _case_output(folder: Path, k: int, n: int) -> tuple[str, str]:
    """A case's stdout and stderr: its ranks', rank by rank."""
    def read(suffix: str) -> str:
        paths = [folder / f"case{k}.rank{r}.{suffix}" for r in range(n)]
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())

    return read("out"), read("err")


def cases_of_items(items: Sequence[pytest.Item], module: Any) -> list[str]:
    """The case ids named by `pytest.mark.cases(...)` on the tests of `module` that will run
    (neither deselected nor skipped by a marker)."""
    wanted: list[str] = []
    for item in items:
        if getattr(item, "module", None) is not module or item.get_closest_marker("skip"):
            continue
        for mark in item.iter_markers("cases"):
            wanted.extend(mark.args)
    return wanted


def case_launches_fixture(script: str | Path, cases: Mapping[str, Case], chunk: int = 16,
                          per_case_s: float = 150) -> Any:
    """A module-scoped fixture `launches`: the module's `CaseLaunches` for its selected tests
    (assign it to a module name: `launches = case_launches_fixture(SCRIPT, CASES)`)."""

    @pytest.fixture(scope="module")
    def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CaseLaunches:
        return CaseLaunches(script, cases, cases_of_items(request.session.items, request.module),
                            tmp_path_factory.mktemp(Path(script).stem), per_case_s, chunk)

    return launches


def case_params(cases: dict[str, Case], kind: str, rows: Sequence[tuple[Any, ...]],
                prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
                full: Sequence[str] = ()) -> list[Any]:
    """One pytest.param per row (ranks, arguments, *rest), id `<ranks>r-<arguments>`, each with
    its case `kind-id` (ranks, `prefix` + arguments, env) added to `cases` and named by
    `pytest.mark.cases`; ids in `full` are marked `full`."""
    out = []
    for n, args, *rest in rows:
        i = f"{n}r-{'_'.join(str(x).lstrip('-') for x in args)}"
        cases[f"{kind}-{i}"] = Case(n, [*prefix, *args], dict(env or {}))
        marks = [pytest.mark.cases(f"{kind}-{i}"), *([pytest.mark.full] if i in full else [])]
        out.append(pytest.param(n, args, *rest, id=i, marks=marks))
    return out


def case_of(request: pytest.FixtureRequest) -> str:
    """The (first) case the running test names with `pytest.mark.cases`."""
    return str(request.node.get_closest_marker("cases").args[0])
