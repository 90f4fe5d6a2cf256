"""Per-rank memory of a BERT trained as a 4-stage pipeline, against the same BERT in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_memory.py            # L8 H768, batch 8 x 128
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_memory.py --layers 2 --hidden 256 --steps 2
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_memory.py --smoke   # 2 x 64 on 2 ranks

The driver (this command) runs three configurations, each in fresh processes, one after another:

* ``plain``: plain PyTorch, no rannc (reference line), one process;
* ``rannc x1``: ``rannc.RaNNCModule`` in one process (the captured graph run as one stage);
* ``rannc x4``: ``mpiexec -n 4`` (gloo, one OpenMP thread per rank), ``partition_num=4`` (4 stages,
  one rank each), ``microbatches=2``.

Each trains ``BertForPreTraining`` with AdamW for ``--steps`` steps on the same global batch (the
pipeline's ranks each feed ``batch / np`` rows of it; rannc's global batch is their concatenation).
Every process writes one JSON file; the driver prints a Markdown table with, per process:

* bytes of parameters held, of gradients (after the last ``backward``) and of AdamW state (after
  the last ``step``), exact, from the tensors (distinct storages, so tied weights count once);
* live tensor bytes beyond those three (every CPU tensor the garbage collector can see after the
  last ``step``, distinct storages): what the process keeps besides the training state;
* peak resident memory increase over a baseline: ``VmRSS`` from ``/proc/self/status`` taken after
  the imports and the batch (and, for the pipeline, after the process group is up), right before
  the model is built, with ``VmHWM`` reset there to the current RSS (writing 5 to
  ``/proc/self/clear_refs``); the peak is ``VmHWM`` minus that baseline, during the first step
  (which includes building the whole model, the capture and, in the pipeline, freeing the
  parameters other stages hold) and, with ``VmHWM`` reset again after the first step, during
  steps 2 and later (steady training). ``ru_maxrss`` cannot be reset, so it is only printed.

The pipeline's layout comes from rannc's planner (``partition_num`` and ``microbatches`` forced,
the cuts its choice), which times rank 0's device, so the cuts can move between runs on a loaded
machine; ``RANNC_SAVE_DEPLOYMENT=1 RANNC_DEPLOYMENT_FILE=/abs/plan.json`` saves the layout and
``RANNC_LOAD_DEPLOYMENT=1`` (same file) reuses it.

Every rank builds the whole model before ``RaNNCModule`` frees what its stage does not hold, so
the first step's peak includes a full copy of the parameters on every rank. RSS also counts what
the C allocator keeps after tensors are freed, so it exceeds the live tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20
_TAG = "_RANNC_BENCH_LAUNCH"
if os.environ.get(_TAG):
    # A rank of a `launch` (its workers import this module): on SIGUSR1, which `launch` sends
    # when the launch runs out of time, print every thread's Python stack, even while the main
    # thread is stuck in native code (a hang is otherwise only "timed out").
    faulthandler.register(signal.SIGUSR1, all_threads=True)


# -- measuring --------------------------------------------------------------------------------
def cores_note(ranks: int) -> str:
    """' (oversubscribed: C cores)' where `ranks` processes share fewer cores than that (this
    process's CPU affinity, which the ranks inherit), else ''."""
    cores = len(os.sched_getaffinity(0))
    return f" (oversubscribed: {cores} cores)" if ranks > cores else ""


def shutdown() -> None:
    """End a rank's process group, once the caller has dropped its DistributedDataParallel
    wrappers (`del ddp`).

    Why: a DDP wrapper's C++ Reducer holds the process group. Were it the last holder (the
    wrapper outliving `destroy_process_group`), freeing it, which Python does holding the
    interpreter lock, destroys the gloo group, which joins the group's worker threads; a worker
    still freeing the work of a collective that just finished (a barrier's, with the tensors of
    the collectives before it) needs that lock to drop their Python objects: a deadlock, in
    perhaps one launch in a hundred on a loaded machine (seen with py-spy: the main thread in
    ~Reducer -> ~ProcessGroupGloo -> thread::join, a worker in ~AsyncWork -> decref_pyobject ->
    gil_scoped_acquire). Freed while the group lives, the Reducer only drops its reference, and
    the group's own destruction releases the lock while it joins."""
    from rannc import dist as rdist

    gc.collect()  # (a wrapper in a reference cycle goes now, not at some later collection)
    rdist.shutdown()


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS: current resident set, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_kb("VmHWM") <= status_kb("VmRSS") + 1024


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct CPU storages behind `tensors` (a tied weight counts once)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or type(t).__name__ == "FakeTensor":
            continue
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def live_tensors() -> list[Any]:
    import torch

    gc.collect()
    with warnings.catch_warnings():  # isinstance() touches deprecated torch.distributed aliases
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


# -- one process of one configuration ---------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining

    import rannc
    from rannc import dist as rdist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    if world > 1:
        rdist.init_process_group(timeout_s=600)
    cfg = BertConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                     num_attention_heads=a.heads, intermediate_size=a.intermediate or 4 * a.hidden,
                     max_position_embeddings=max(512, a.seq))
    if a.dropout is not None:
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = a.dropout
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (a.batch, a.seq), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                 token_type_ids=(torch.arange(a.seq) >= a.seq // 2).long().expand(a.batch, a.seq),
                 labels=ids.clone(), next_sentence_label=torch.randint(0, 2, (a.batch,), generator=g))
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world  # this rank's rows
    batch = {k: v[lo:hi].contiguous() for k, v in batch.items()}
    gc.collect()
    base_kb = status_kb("VmRSS")
    hwm_reset = reset_peak()

    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    built_kb = status_kb("VmRSS")
    n_model = sum(p.numel() for p in model.parameters())  # distinct parameters of the whole model
    run: torch.nn.Module = model
    opts: dict[str, Any] = {}
    if world > 1:
        opts = dict(partition_num=a.partition_num or world, microbatches=a.microbatches)
    if a.mode == "rannc":
        run = rannc.RaNNCModule(model, opt, **opts)
    grads_b = 0
    step_s, losses = [], []
    steady_kb = 0
    for step in range(a.steps):
        t0 = time.perf_counter()
        loss = run(**batch).loss
        losses.append(loss.item())
        loss.backward()
        if step == a.steps - 1:
            grads_b = storage_bytes(p.grad for p in model.parameters())
        opt.step()
        if step == a.steps - 1:
            live = live_tensors()
            params_b = storage_bytes(model.parameters())
            state_b = storage_bytes(t for st in opt.state.values() for t in st.values())
            live_b = storage_bytes(live)
            held = [n for n, p in model.named_parameters(remove_duplicate=False) if p.numel()]
            del live
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        if step == 0:
            peak0_kb = status_kb("VmHWM")
            gc.collect()
            steady_base_kb = status_kb("VmRSS")
            reset_peak()
        else:
            steady_kb = status_kb("VmHWM")
    plan = getattr(run, "plan", None)
    out = dict(
        config=a.label, mode=a.mode, rank=rank, world=world,
        stage=plan.stage_of_rank(rank).index if plan else 0,
        recompute=plan.stage_of_rank(rank).recompute if plan else False,
        plan=plan.summary() if plan and rank == 0 else None,
        model_params=n_model, held_params=sum(p.numel() for p in model.parameters()),
        held_names=held, params_bytes=params_b, grads_bytes=grads_b, state_bytes=state_b,
        live_bytes=live_b, base_rss_kb=base_kb, hwm_reset=hwm_reset,
        built_kb=built_kb - base_kb,
        peak0_kb=peak0_kb - base_kb,
        steady_kb=(steady_kb - base_kb) if a.steps > 1 else None,
        steady_base_kb=steady_base_kb - base_kb, end_rss_kb=status_kb("VmRSS") - base_kb,
        ru_maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        step_s=step_s, losses=losses,
    )
    Path(a.out, f"{a.label}.rank{rank}.json").write_text(json.dumps(out, indent=1))
    if world > 1:
        rdist.shutdown()


# -- the driver -------------------------------------------------------------------------------
def mpiexec() -> str:
    """The mpiexec next to the interpreter (the mpich wheel's), else the one on PATH; without
    one, the benchmark exits naming the fix."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        sys.exit("no mpiexec next to the interpreter or on PATH (pip install mpi4py mpich)")
    return found


def _tagged(token: str) -> list[tuple[int, bytes]]:
    """(pid, command line) of every process carrying this launch's tag (Hydra and the ranks call
    setsid, so they are not in our process group)."""
    needle = f"{_TAG}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append((int(entry.name), (entry / "cmdline").read_bytes()))
        except (OSError, ValueError):
            continue
    return found


def _kill_tagged(token: str) -> None:
    """SIGKILL every process carrying this launch's tag."""
    for pid, _ in _tagged(token):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _dump_tagged(token: str) -> None:
    """Every rank of a launch that ran out of time prints where its threads are (SIGUSR1, see
    `faulthandler.register` at the top) to its stderr, which mpiexec passes on; the ranks live
    on until `launch` kills them. Only the Python ranks get the signal (not mpiexec or Hydra's
    proxies)."""
    ranks = [pid for pid, cmd in _tagged(token) if Path(cmd.split(b"\0")[0].decode(errors="replace")).name
             .startswith("python")]
    print(f"  timed out: stacks of ranks (pids {ranks}) follow on stderr", flush=True)
    for pid in ranks:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2)


def launch(cmd: list[str], timeout: float) -> None:
    token = uuid.uuid4().hex
    # RANNC_* settings pass through (e.g. RANNC_SAVE_DEPLOYMENT / RANNC_LOAD_DEPLOYMENT with an
    # absolute RANNC_DEPLOYMENT_FILE to pin the pipeline's layout across runs); those of an outer
    # launcher do not.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_HOST_FILE"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("RANNC_BACKEND", "gloo")
    env.update({_TAG: token, "OMP_NUM_THREADS": "1", "HYDRA_LAUNCHER": "fork",
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _dump_tagged(token)  # while mpiexec still runs, so the stacks get through
            proc.kill()
            proc.wait()
            raise
        if rc:
            raise subprocess.CalledProcessError(rc, cmd)
    finally:
        _kill_tagged(token)
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one row per process, then the pipeline's sum over its ranks."""
    one = next(r for r in rows if r["config"] == "rannc_x1")
    ref_state = one["params_bytes"] + one["grads_bytes"] + one["state_bytes"]

    def state(r: dict[str, Any]) -> int:
        return int(r["params_bytes"] + r["grads_bytes"] + r["state_bytes"])

    def cells(r: dict[str, Any] | list[dict[str, Any]]) -> list[str]:
        rs = r if isinstance(r, list) else [r]
        tot = {k: sum(x[k] or 0 for x in rs) for k in ("held_params", "params_bytes", "grads_bytes",
                                                       "state_bytes", "peak0_kb", "steady_kb")}
        st = sum(state(x) for x in rs)
        other = "" if isinstance(r, list) else f"{(r['live_bytes'] - st) / MB:.0f}"
        steady = tot["steady_kb"] if one["steady_kb"] else float("nan")
        return [f"{tot['held_params'] / 1e6:.2f}", f"{tot['params_bytes'] / MB:.0f}",
                f"{tot['grads_bytes'] / MB:.0f}", f"{tot['state_bytes'] / MB:.0f}", f"{st / MB:.0f}",
                f"{st / ref_state:.3f}", other, f"{tot['peak0_kb'] / 1024:.0f}",
                f"{tot['peak0_kb'] / one['peak0_kb']:.3f}", f"{steady / 1024:.0f}",
                f"{steady / (one['steady_kb'] or 1):.3f}"]

    head = ["run", "stage", "params held (M)", "params MB", "grads MB", "AdamW state MB", "sum MB",
            "sum / x1", "other live tensors MB", "peak RSS incr. step 1 MB", "/ x1",
            "peak RSS incr. steps 2+ MB", "/ x1"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        name = {"plain": "plain PyTorch, 1 process", "rannc_x1": "rannc, 1 process"}.get(
            r["config"], f"rannc x{r['world']}, rank {r['rank']}")
        lines.append("| " + " | ".join([name, str(r["stage"]), *cells(r)]) + " |")
    multi = [r for r in rows if r["world"] > 1]
    if multi:
        lines.append("| " + " | ".join([f"**sum of the {len(multi)} ranks**", "", *cells(multi)]) + " |")
    return "\n".join(lines)


def driver(a: argparse.Namespace) -> None:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if a.np > 1 and mpiexec is None:
        sys.exit("no mpiexec next to the interpreter or on PATH (pip install mpi4py mpich)")
    if a.batch % a.np:
        sys.exit(f"--batch {a.batch} must divide among --np {a.np} ranks")
    out = Path(tempfile.mkdtemp(prefix="rannc_pipeline_memory_"))
    common = [f"--{k}={v}" for k, v in (("layers", a.layers), ("hidden", a.hidden), ("heads", a.heads),
                                        ("intermediate", a.intermediate), ("vocab", a.vocab),
                                        ("batch", a.batch), ("seq", a.seq), ("steps", a.steps),
                                        ("microbatches", a.microbatches), ("dropout", a.dropout),
                                        ("partition-num", a.partition_num), ("out", out)) if v is not None]
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        launch([*me, "--worker", "plain", "--label", "plain", *common], a.timeout)
        launch([*me, "--worker", "rannc", "--label", "rannc_x1", *common], a.timeout)
        if a.np > 1:
            launch([mpiexec or "mpiexec", "-n", str(a.np), *me, "--worker", "rannc",
                    "--label", f"rannc_x{a.np}", *common], a.timeout)
        rows = [json.loads(p.read_text()) for p in
                sorted(out.glob("*.json"), key=lambda p: ("plain" not in p.name, p.name))]
        if a.keep:
            print(f"per-process JSON kept in {out}")
    finally:
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    first = rows[0]
    print(f"\nBertForPreTraining L{a.layers} H{a.hidden} A{a.heads} I{a.intermediate or 4 * a.hidden} "
          f"vocab {a.vocab}: {first['model_params'] / 1e6:.2f} M distinct parameters; AdamW; global batch "
          f"{a.batch} x {a.seq}; {a.steps} steps; pipeline: {a.np} ranks, partition_num "
          f"{a.partition_num or a.np}, {a.microbatches} microbatches")
    for r in rows:
        if r.get("plan"):
            print(r["plan"])
    for r in rows:
        tied = [n for n in r["held_names"] if "word_embeddings" in n or "decoder.weight" in n]
        secs = ", ".join(f"{x:.1f}" for x in r["step_s"])
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{r['config']:>9} rank {r['rank']} stage {r['stage']} recompute {r['recompute']}: "
              f"{len(r['held_names'])} parameter names held, embedding-tied {tied}; "
              f"VmHWM reset {'ok' if r['hwm_reset'] else 'FAILED'}; baseline VmRSS "
              f"{r['base_rss_kb'] / 1024:.0f} MB; VmRSS after build +{r['built_kb'] / 1024:.0f} MB, "
              f"after step 1 +{r['steady_base_kb'] / 1024:.0f} MB, at end +{r['end_rss_kb'] / 1024:.0f} MB; "
              f"ru_maxrss {r['ru_maxrss_kb'] / 1024:.0f} MB; s/step {secs}; loss {losses}")
    print()
    print(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--batch", type=int, default=8, help="global batch (split evenly among the ranks)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--np", type=int, default=4, help="ranks of the pipeline run")
    p.add_argument("--partition-num", type=int, default=0, help="stages (0: one per rank)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout (BERT's 0.1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--keep", action="store_true", help="keep the per-process JSON files")
    p.add_argument("--worker", choices=("plain", "rannc"), help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="BERT 2 x 64 on 2 ranks, 2 steps: seconds")
    a = p.parse_args()
    if a.smoke and not a.worker:
        a.layers, a.hidden, a.heads, a.intermediate, a.vocab = 2, 64, 2, 256, 128
        a.batch, a.seq, a.steps, a.np, a.timeout = 4, 16, 2, 2, min(a.timeout, 300)
    if a.worker:
        a.mode = a.worker
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
