"""Several cases of the check scripts in one launch (tests/mpi_harness.py's CaseLaunches).

    mpiexec -n 4 python tests/scripts/case_batch.py SPEC.json

A launch's start-up (the interpreter, torch, the process group, the device measurement) costs
far more than a small case, so the tests run the cases that need the same ranks in one launch.
SPEC.json names an output folder, a time limit per case and the cases in order, each a check
script of this folder (a module with `parse(argv)` and `run(args, ctx)`), its argument list and
the environment variables it sets:

    {"out_dir": "...", "case_limit_s": 150,
     "cases": [{"id": "...", "script": "pipeline_check", "args": [...],
                "env": {"RANNC_ZERO_STAGE": "1"}}]}

Each case runs as the script alone would run it, with its environment set around it and its
stdout, stderr and logging written to `out_dir/case<k>.rank<r>.out` / `.err`, so that a test
reads exactly what its own case printed. After a case ends on a rank, the rank writes
`case<k>.rank<r>.done` (files, not a line: a launch killed at its time limit loses its pipes but
not what its finished cases wrote). A case that raises writes its traceback to its `.err` file and
ends the launch (the other ranks may be inside a collective it will never reach), and the
harness relaunches with the cases after it. A case still running on a rank after `case_limit_s`
(a hang) ends the launch the same way, its rank's stacks written to the launch's stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib
import json
import logging
import os
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from rannc import dist as rdist  # noqa: E402


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _fresh_process_state() -> Iterator[None]:
    """Each case starts from the state it would find in a process of its own, whatever the case
    before it did: the environment (its own variables set), the RNG streams, the default dtype,
    grad mode and deterministic-algorithms mode."""
    env, rng, py_rng = dict(os.environ), torch.get_rng_state(), random.getstate()
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(deterministic)


@contextlib.contextmanager
def _output(out: Path, err: Path) -> Iterator[None]:
    """stdout, stderr and every logging stream handler into these files while the case runs;
    a case's exception is written to its .err file too before it propagates."""
    handlers = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]
    with out.open("w") as fo, err.open("w") as fe:
        streams = [h.setStream(fe) for h in handlers]
        try:
            with contextlib.redirect_stdout(fo), contextlib.redirect_stderr(fe):
                try:
                    yield
                except BaseException:
                    traceback.print_exc(file=fe)
                    raise
        finally:
            for h, s in zip(handlers, streams, strict=True):
                if s is not None:
                    h.setStream(s)


def main(parse: Callable[[list[str]], argparse.Namespace],
         run: Callable[[argparse.Namespace, rdist.DistContext], Any], timeout_s: float = 60) -> None:
    """A check script's own entry point: its command line is one case (`timeout_s`: the
    process group's, as the script's PROCESS_GROUP_TIMEOUT_S says to the batch runner)."""
    a = parse(sys.argv[1:])
    run(a, rdist.init_process_group(timeout_s=timeout_s))
    rdist.shutdown()


def run_cases(spec_path: Path) -> None:
    """Every case of SPEC in this launch, in order (the module docstring)."""
    spec = json.loads(spec_path.read_text())
    out_dir = Path(spec["out_dir"])
    scripts = {c["script"]: importlib.import_module(c["script"]) for c in spec["cases"]}
    timeout_s = max(getattr(m, "PROCESS_GROUP_TIMEOUT_S", 60) for m in scripts.values())
    ctx = rdist.init_process_group(timeout_s=timeout_s)
    limit_s = spec.get("case_limit_s")
    for k, case in enumerate(spec["cases"]):
        if limit_s:  # (the launch's stderr: sys.stderr before the case's own is set)
            faulthandler.dump_traceback_later(limit_s, exit=True)
        script = scripts[case["script"]]
        stem = f"case{k}.rank{ctx.rank}"
        # rannc's log level as the script's own main sets it (pipeline_check: INFO, for the plan)
        logging.getLogger("rannc").setLevel(getattr(script, "RANNC_LOG_LEVEL", logging.NOTSET))
        # (catch_warnings: a warning shown once per process shows again in each case)
        with (_fresh_process_state(), _environment(case.get("env", {})), warnings.catch_warnings(),
              _output(out_dir / f"{stem}.out", out_dir / f"{stem}.err")):
            script.run(script.parse(list(case["args"])), ctx)
        gc.collect()  # the case's modules and their groups go before the next case's
        (out_dir / f"{stem}.done").touch()
        # No rank starts the next case before every rank has ended this one: a next case that
        # fails at once on one rank aborts the launch, which must not cut another rank's end.
        torch.distributed.barrier()
        faulthandler.cancel_dump_traceback_later()
    rdist.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)  # (as pipeline_check.py's own main sets it)
    run_cases(Path(sys.argv[1]))
