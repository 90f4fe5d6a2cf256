"""Runtime of rannc against torch.distributed.pipelining and DDP on the same stages (issue 8, study 2).

    PYTHONPATH=. .venv/bin/python benchmarks/runtime_peers.py            # BERT + ResNet, 2 and 4 ranks
    PYTHONPATH=. .venv/bin/python benchmarks/runtime_peers.py --smoke    # tiny, 2 ranks, 1 repeat

A small BERT (pre-LN transformer layers between an embedding and a vocabulary head) and a small
ResNet (pre-activation bottlenecks), each written as ``nn.Sequential`` of layers wrapped by a
module that returns the loss, so both tools can be split at the same layer boundaries. rannc gets
the wrapper as it is (an unmodified ``nn.Module``). Variants, each in fresh ``mpiexec`` ranks
(gloo, one OpenMP thread per rank):

* ``rannc auto``: ``RaNNCModule`` with nothing forced;
* ``rannc gpipe`` / ``rannc 1f1b``: forced to one stage per rank, ``--microbatches``, no
  recomputation, that schedule;
* ``pipelining GPipe`` / ``pipelining 1F1B``: ``torch.distributed.pipelining``'s
  ``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``, stages cut at the layer
  boundaries of the rannc plan of the same schedule (read from its saved deployment file), the
  same microbatch count;
* ``rannc gpipe, step-start sync`` / ``rannc 1f1b, step-start sync``: the same runs with
  rannc's guess of the row layout turned off, so every step waits for the ranks' row counts
  before it starts (rannc before that guess; compared with the rows above);
* ``DDP``: ``DistributedDataParallel`` over the whole model, each rank its rows.

All train with AdamW from the same seed on the same global batches. The driver runs the variants
round-robin over ``--repeats`` (so load on the machine hits all alike) and reports medians.
rannc plans once (first repeat) and reloads its plan after, so every repeat runs the same stages.
Per variant and rank: samples/s over ``--steps`` steps after ``--warmup`` steps (rank 0's clock,
between barriers), and the peak resident memory during the measured steps above the baseline taken
after imports and data, before the model is built (``VmHWM`` reset after warm-up, as in
``benchmarks/pipeline_memory.py``), and the CPU time each rank's process used per measured step
(its own work and its threads', not its waits: less sensitive than wall time to other tenants of
a shared machine), and the minor page faults per measured step (a fresh zero-filled page per
4 KiB wherever the C allocator maps a freed block afresh: rannc's ``host_malloc`` "auto" keeps
freed blocks in the heap on a CPU, ``--malloc reuse`` gives every variant the same setting).
The loss of the last measured step is printed per variant: rannc and
pipelining on the same stages must agree (they train the same thing).

``RUNTIME_PEERS_PROFILE=DIR`` runs the measured steps under torch.profiler and writes, per
variant and rank, the table of the top operators and every operator's calls and self time
(``*.counts.tsv``). ``RUNTIME_PEERS_CPROFILE=DIR`` runs them under cProfile and writes each
rank's stats (``*.prof``, for ``pstats``): the Python each library runs around the operators.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_memory as pm  # noqa: E402  (its launcher and VmHWM helpers)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("rannc_auto", "rannc_gpipe", "rannc_1f1b", "rannc_gpipe_sync", "rannc_1f1b_sync",
            "rannc_gpipe_late", "rannc_1f1b_late", "pipe_gpipe", "pipe_1f1b", "ddp", "rannc_zb",
            "rannc_i1f1b", "rannc_zbv", "pipe_zb", "pipe_i1f1b", "pipe_zbv")
# zero-bubble and interleaved (issue 19): rannc's zero_bubble (ZB-H1) on one stage per rank;
# pipelining's ScheduleInterleavedZeroBubble on the same stages, and its ScheduleInterleaved1F1B
# and ScheduleZBVZeroBubble on two stages per rank, cut where rannc's interleaved_1f1b plan cuts
# (rannc's interleaved_1f1b runs those very stages, and rannc's zero_bubble_v runs them placed
# in a V as ZBV does)
NEW_VARIANTS = ("rannc_1f1b", "rannc_zb", "rannc_i1f1b", "rannc_zbv", "pipe_1f1b", "pipe_zb",
                "pipe_i1f1b", "pipe_zbv")
SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "zb": "zero_bubble", "i1f1b": "interleaved_1f1b",
            "zbv": "interleaved_1f1b"}  # variant suffix -> the rannc schedule its stages come from
SMOKE_VARIANTS = ("rannc_1f1b", "pipe_1f1b", "ddp")
NAMES = {"rannc_auto": "rannc auto", "rannc_gpipe": "rannc gpipe", "rannc_1f1b": "rannc 1f1b",
         "pipe_gpipe": "pipelining ScheduleGPipe", "pipe_1f1b": "pipelining Schedule1F1B",
         "ddp": "DDP", "rannc_gpipe_sync": "rannc gpipe, step-start sync",
         "rannc_1f1b_sync": "rannc 1f1b, step-start sync",
         "rannc_gpipe_late": "rannc gpipe, receives posted when taken",
         "rannc_1f1b_late": "rannc 1f1b, receives posted when taken", "rannc_zb": "rannc zero_bubble",
         "rannc_i1f1b": "rannc interleaved_1f1b (2 stages per rank)",
         "rannc_zbv": "rannc zero_bubble_v (2 stages per rank)",
         "pipe_zb": "pipelining ScheduleInterleavedZeroBubble",
         "pipe_i1f1b": "pipelining ScheduleInterleaved1F1B (2 stages per rank)",
         "pipe_zbv": "pipelining ScheduleZBVZeroBubble (2 stages per rank)"}
# the rannc row each variant is compared with
COUNTERPART = {"rannc_auto": "rannc_auto", "rannc_gpipe": "rannc_auto", "rannc_1f1b": "rannc_auto",
               "pipe_gpipe": "rannc_gpipe", "pipe_1f1b": "rannc_1f1b", "ddp": "rannc_auto",
               "rannc_gpipe_sync": "rannc_gpipe", "rannc_1f1b_sync": "rannc_1f1b",
               "rannc_gpipe_late": "rannc_gpipe", "rannc_1f1b_late": "rannc_1f1b",
               "rannc_zb": "rannc_1f1b", "rannc_i1f1b": "rannc_1f1b", "pipe_zb": "rannc_zb",
               "rannc_zbv": "rannc_1f1b", "pipe_i1f1b": "rannc_i1f1b", "pipe_zbv": "rannc_zbv"}
LOSS_RTOL = 1e-3  # float32 sums in another order over a few steps


# -- the models: a sequence of layers, and a wrapper returning the loss ----------------------
def build(name: str, a: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(wrapper returning the loss, its nn.Sequential of layers, loss_fn(output, target))."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.hidden)
            self.pos = nn.Parameter(torch.randn(a.seq, a.hidden) * 0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.tok(ids) + self.pos  # (B, S, H)

    class Block(nn.Module):
        """A pre-LN transformer layer (BERT's, with the norms moved before each sublayer)."""

        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(a.hidden), nn.LayerNorm(a.hidden)
            self.qkv, self.proj = nn.Linear(a.hidden, 3 * a.hidden), nn.Linear(a.hidden, a.hidden)
            self.fc1, self.fc2 = nn.Linear(a.hidden, 4 * a.hidden), nn.Linear(4 * a.hidden, a.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, S, H = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, a.heads, H // a.heads).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + self.proj(att.transpose(1, 2).reshape(B, S, H))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Head(nn.Sequential):
        def __init__(self, *mods: nn.Module) -> None:
            super().__init__(*mods)

    class Wrapper(nn.Module):
        def __init__(self, layers: nn.Sequential, loss_fn: Any) -> None:
            super().__init__()
            self.layers, self.loss_fn = layers, loss_fn

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(self.layers(x), y)

    torch.manual_seed(0)
    if name == "bert":
        layers = nn.Sequential(Embed(), *[Block() for _ in range(a.layers)],
                               Head(nn.LayerNorm(a.hidden), nn.Linear(a.hidden, a.vocab)))

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
    elif name == "standin":  # layers that sleep instead of computing (benchmarks/stand_in.py)
        from stand_in import layers as wait_layers

        layers = wait_layers(a.layers, a.hidden, a.t_f / 1e3, a.t_b / 1e3, a.t_w / 1e3)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(out, y)
    else:
        from examples.models.resnet import PreActBottleneck

        c = a.channels
        units: list[nn.Module] = [nn.Conv2d(3, c, 3, padding=1, bias=False)]
        cin = c
        for i in range(a.units):
            cout, stride = c * 4 * 2 ** (i // 2), 2 if i and i % 2 == 0 else 1
            units.append(PreActBottleneck(cin, cout, cout // 4, stride))
            cin = cout
        units.append(Head(nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(cin, 10)))
        layers = nn.Sequential(*units)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, y)
    return Wrapper(layers, loss_fn), layers, loss_fn


def batches(name: str, a: argparse.Namespace, n: int) -> list[tuple[Any, Any]]:
    """`n` global batches (x, y), the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(1)
    if name == "standin":
        return [(torch.randn(a.batch, a.hidden, generator=g), torch.randn(a.batch, a.hidden, generator=g))
                for _ in range(n)]
    if name == "bert":
        out = []
        for _ in range(n):
            x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
            out.append((x, torch.roll(x, -1, dims=1)))
        return out
    return [(torch.randn(a.batch, 3, a.image, a.image, generator=g),
             torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(n)]


def v_plan(src: Path, dst: Path) -> Path:
    """`src`'s plan of 2P stages on P pipeline positions (interleaved: stage s on position
    s % P) under zero_bubble_v: the same stages, stage s on position s or 2P - 1 - s (a V)."""
    import dataclasses

    import rannc
    from rannc.schedule import default_placement

    if not dst.exists():
        plan = rannc.Plan.load(src)
        lanes = {plan.placement()[s]: st.ranks for s, st in enumerate(plan.stages)}
        place = default_placement("zero_bubble_v", len(plan.stages))
        stages = tuple(dataclasses.replace(st, ranks=lanes[place[s]],
                                           shares=plan.stages[place[s]].shares)
                       for s, st in enumerate(plan.stages))
        dataclasses.replace(plan, schedule="zero_bubble_v", stages=stages).save(dst)
    return dst


def stage_bounds(plan_file: Path, n_layers: int) -> tuple[list[int], bool]:
    """Layer index where each stage of a saved rannc plan starts, and whether every stage holds
    whole layers (no layer cut in two)."""
    plan = json.loads(plan_file.read_text())
    spans = []
    for st in plan["stages"]:
        idx = sorted({int(n.split(".")[1]) for n in st["param_names"] if n.startswith("layers.")})
        spans.append((idx[0], idx[-1]) if idx else None)
    starts, whole, prev_hi = [0], True, spans[0][1] if spans[0] else 0
    for sp in spans[1:]:
        if sp is None:
            raise SystemExit(f"{plan_file}: a stage holds no layer parameters; cannot mirror it")
        whole &= sp[0] > prev_hi
        starts.append(prev_hi + 1 if sp[0] <= prev_hi else sp[0])
        prev_hi = sp[1]
    return starts + [n_layers], whole


def aligned_plan(name: str, a: argparse.Namespace, n: int, schedule: str, path: Path,
                 stages: int = 0) -> str:
    """rannc's plan for one stage per rank with this schedule (or `stages` stages), its cuts
    moved to the nearest layer boundary (saved to `path` for the rannc run to load), so that
    pipelining can run the very same stages; returns a note of what was moved."""
    import dataclasses

    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import param_names_of
    from rannc.profile.device import measure_local_device

    wrapper, _, _ = build(name, a)
    (x, y), = batches(name, a, 1)
    cluster = rannc.Cluster.homogeneous(measure_local_device(), n=n, per_node=n)
    cfg = rannc.Config(partition_num=stages or n, microbatches=a.microbatches, checkpointing="off",
                       schedule=schedule)
    plan = rannc.plan(wrapper, (x, y), cluster=cluster, config=cfg)
    graph = capture(wrapper, (x, y), {}).graph
    atomic = atomic_components(graph)
    layer_of, cur = [], 0  # a component without layer parameters belongs to the layer before it
    for c in range(len(atomic.components)):
        idx = [int(p.split(".")[1]) for p in param_names_of(graph, atomic, [c]) if p.startswith("layers.")]
        cur = idx[0] if idx else cur
        layer_of.append(cur)
    if name == "standin":
        # a stand-in layer is (its forward wait, then the addition reading its weight): a
        # component without parameters starts the next layer; the estimate oracle prices the
        # sleeps at nothing, so the stages are cut evenly by layers instead of by its plan
        layer_of = [next((layer_of[d] for d in range(c, len(layer_of))
                          if param_names_of(graph, atomic, [d])), layer_of[-1])
                    for c in range(len(layer_of))]
    first = {}
    for c, lay in enumerate(layer_of):
        first.setdefault(lay, c)
    notes, cuts = [], []
    if name == "standin":
        S = len(plan.stages)
        if a.layers % S:
            raise SystemExit(f"--layers {a.layers} is not a multiple of the {S} stages")
        cuts = [first[s * a.layers // S] for s in range(1, S)]
    for st in plan.stages[1:] if name != "standin" else ():
        c = st.components[0]
        lay = layer_of[c]
        if c == first[lay]:
            cuts.append(c)
            continue
        nxt = first.get(lay + 1, len(layer_of))
        to = first[lay] if c - first[lay] <= nxt - c else nxt
        notes.append(f"cut inside layer {lay} (component {c}) moved to component {to}")
        cuts.append(to)
    if any(b <= a for a, b in zip([0, *cuts], [*cuts, len(layer_of)], strict=True)):
        # two cuts moved onto one boundary (as many stages as layers, say): a stage would hold
        # no layer, which pipelining cannot run; cut evenly by layers instead, for both
        S, L = len(plan.stages), len(first)
        if L < S:
            raise SystemExit(f"{S} stages need at least {S} layers; the model has {L}")
        cuts = [first[s * L // S] for s in range(1, S)]
        notes = [f"moved cuts met on one layer boundary: rannc's stages, cut evenly by layers at "
                 f"components {cuts}"]
    bounds = [0, *cuts, len(layer_of)]
    stages = []
    for st, lo, hi in zip(plan.stages, bounds, bounds[1:], strict=False):
        comps = tuple(range(lo, hi))
        stages.append(dataclasses.replace(st, components=comps, recompute=0.0,
                                          param_names=param_names_of(graph, atomic, comps)))
    dataclasses.replace(plan, stages=tuple(stages)).save(path)
    if name == "standin":
        return f"rannc's stages, cut evenly by layers at components {cuts}"
    return "; ".join(notes) or "rannc's cuts are at layer boundaries"


# -- one process of one variant ---------------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import rannc
    from rannc import dist as rdist

    rdist.init_process_group(timeout_s=600)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    data = batches(a.model, a, a.warmup + a.steps)
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world  # this rank's rows
    base_kb = pm.status_kb("VmRSS")
    wrapper, layers, loss_fn = build(a.model, a)
    v = a.variant
    layout = ""
    if v.endswith("_sync"):
        # rannc as before it ran a call on the last call's row layout: every step waits for
        # the ranks' row counts before it starts (the old behaviour, side by side)
        from rannc.pipeline.runtime import PipelineRuntime

        PipelineRuntime.guess_sizes = lambda self, agreement: None  # type: ignore[method-assign]
    if v.endswith("_late"):
        # rannc as before it posted each receive while the action before it ran: every
        # receive posted (and the transfer begun) when the action taking it gets to it
        from rannc.pipeline.executor import Executor

        Executor._expect = lambda self, call, a, settle=False: None  # type: ignore[method-assign]
    if v.startswith("rannc"):
        opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
        opts: dict[str, Any] = dict(save_deployment=True, load_deployment=True,
                                    deployment_file=a.plan_file)
        if v != "rannc_auto":
            opts.update(partition_num=2 * world if v in ("rannc_i1f1b", "rannc_zbv") else world,
                        microbatches=a.microbatches, checkpointing="off",
                        schedule="zero_bubble_v" if v == "rannc_zbv" else SCHEDULE[v.split("_")[1]])
        model = rannc.RaNNCModule(wrapper, opt, **opts)

        def step(x: Any, y: Any) -> float:
            loss = model(x[lo:hi], y[lo:hi])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.item())
    elif v == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(wrapper)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        layout = f"1 x {world}"

        def step(x: Any, y: Any) -> float:
            loss = ddp(x[lo:hi], y[lo:hi])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out = loss.detach().clone() / world
            dist.all_reduce(out)
            return float(out.item())
    else:
        from torch.distributed import pipelining as pp

        starts = [int(s) for s in a.bounds.split(",")]
        S = len(starts) - 1
        # the stages this rank holds: its own, or two (interleaved: r and r + P; V: r, 2P-1-r)
        idx = [rank] if S == world else [rank, rank + world] if v == "pipe_i1f1b" \
            else [rank, S - 1 - rank]
        mods = [torch.nn.Sequential(*layers[starts[i]:starts[i + 1]]) for i in idx]
        del wrapper, layers
        opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-3)
        stages = [pp.PipelineStage(m, i, S, torch.device("cpu")) for m, i in zip(mods, idx, strict=True)]
        kind = {"pipe_gpipe": pp.ScheduleGPipe, "pipe_1f1b": pp.Schedule1F1B,
                "pipe_zb": pp.ScheduleInterleavedZeroBubble, "pipe_i1f1b": pp.ScheduleInterleaved1F1B,
                "pipe_zbv": pp.ScheduleZBVZeroBubble}[v]
        multi = v in ("pipe_zb", "pipe_i1f1b", "pipe_zbv")
        sched = kind(stages if multi else stages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
        layout = f"{world} x 1" if S == world else f"{S} stages on {world} ranks"
        first, last = 0 in idx, S - 1 in idx
        last_rank = (S - 1) % world if v == "pipe_i1f1b" else 0 if v == "pipe_zbv" else world - 1

        def step(x: Any, y: Any) -> float:
            losses: list[torch.Tensor] = []
            if a.size_sync:  # rannc's start of a step: every rank's row count, gathered
                rows = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
                dist.all_gather(rows, torch.tensor([hi - lo]))
            if first and last:
                sched.step(x, target=y, losses=losses)
            elif first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            opt.step()
            opt.zero_grad()
            out = torch.stack(losses).mean() if losses else torch.zeros(())
            dist.broadcast(out, src=last_rank)
            return float(out.item())

    losses = [step(x, y) for x, y in data[:a.warmup]]
    dist.barrier()
    pm.reset_peak()
    prof_dir = os.environ.get("RUNTIME_PEERS_PROFILE")  # a folder: torch.profiler tables per rank
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if prof_dir else None
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = time.perf_counter(), time.process_time()
    cprof_dir = os.environ.get("RUNTIME_PEERS_CPROFILE")  # a folder: Python's profile per rank
    cprof = cProfile.Profile() if cprof_dir else None
    with prof or contextlib.nullcontext(), cprof or contextlib.nullcontext():
        losses += [step(x, y) for x, y in data[a.warmup:]]
    if cprof is not None and cprof_dir:
        cprof.dump_stats(str(Path(cprof_dir, f"{a.label}.rank{rank}.prof")))
    dist.barrier()
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - c0  # this rank's own work (and gloo's threads), not its waits
    # minor page faults: a fresh zero-filled page per 4 KiB wherever the C allocator maps a
    # freed block afresh (`Config.host_malloc`, `--malloc`)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - ru0.ru_minflt
    if prof is not None and prof_dir:
        Path(prof_dir, f"{a.label}.rank{rank}.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        # every operator's calls and self time, to set two variants side by side by counts
        # (which the machine's load leaves alone) as well as by time
        Path(prof_dir, f"{a.label}.rank{rank}.counts.tsv").write_text("\n".join(
            f"{e.key}\t{e.count}\t{e.self_cpu_time_total / 1e3:.1f}" for e in prof.key_averages()))
    peak_kb = pm.status_kb("VmHWM") - base_kb
    if v.startswith("rannc"):
        plan = model.plan
        reps = [st.replicas for st in plan.stages]
        layout = f"{len(reps)} x {reps[0]}" if len(set(reps)) == 1 else f"replicas {reps}"
        mbs, sched_name = plan.microbatches, plan.schedule
    elif v == "ddp":
        mbs, sched_name = 1, "-"
    else:
        mbs, sched_name = a.microbatches, NAMES[v].split()[1]
    out = dict(variant=v, rank=rank, world=world, elapsed=elapsed,
               samples_s=a.batch * a.steps / elapsed,
               cpu_ms_step=1e3 * cpu_s / a.steps, faults_step=faults / a.steps,
               peak_mb=peak_kb / 1024, layout=layout, microbatches=mbs, schedule=sched_name, losses=losses)
    Path(a.out, f"{a.label}.rank{rank}.json").write_text(json.dumps(out))
    if v == "ddp":
        del ddp  # before the process group goes (`pm.shutdown`)
    pm.shutdown()


# -- the driver -------------------------------------------------------------------------------
def model_args(name: str, a: argparse.Namespace) -> list[str]:
    keys = {"bert": ("vocab", "hidden", "layers", "heads", "seq"), "resnet": ("channels", "units", "image"),
            "standin": ("hidden", "layers", "t_f", "t_b", "t_w")}[name]
    return [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys] + [f"--batch={a.batch_of[name]}"]


def n_layers(name: str, a: argparse.Namespace) -> int:
    return {"bert": a.layers + 2, "resnet": a.units + 2, "standin": a.layers}[name]


def driver(a: argparse.Namespace) -> None:
    mpiexec = pm.mpiexec()
    if a.malloc == "reuse":  # the environment the launched ranks inherit (`pm.launch`)
        from rannc.hostmem import REUSE_THRESHOLD

        os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = str(REUSE_THRESHOLD)
    tmp = Path(tempfile.mkdtemp(prefix="rannc_runtime_peers_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    variants = SMOKE_VARIANTS if a.smoke else tuple(v for v in VARIANTS if v in a.variants)
    cases = [(m, n) for m in a.models for n in a.ranks]
    results: dict[tuple[str, int, str], list[list[dict[str, Any]]]] = {}
    split_layer: set[tuple[str, int, str]] = set()  # pipelining runs whose rannc plan cut a layer
    moved: set[tuple[str, int, str]] = set()  # rannc runs whose cut was moved to a layer boundary
    try:
        for rep in range(a.repeats):
            for model, n in cases:
                for v in variants:
                    label = f"{model}_{n}_{v}_{rep}"
                    src = "rannc_" + v.split("_")[1] if v.startswith("pipe") \
                        or v.endswith(("_sync", "_late")) else v
                    src = "rannc_i1f1b" if src == "rannc_zbv" else src  # the same 2P stages
                    plan_file = tmp / f"plan_{model}_{n}_{src}.json"
                    extra = [f"--plan-file={plan_file}"]
                    made = v in ("rannc_gpipe", "rannc_1f1b", "rannc_zb", "rannc_i1f1b") \
                        or src == "rannc_i1f1b"
                    if rep == 0 and made and not plan_file.exists():
                        ns = argparse.Namespace(**{**vars(a), "batch": a.batch_of[model]})
                        two = src == "rannc_i1f1b"
                        note = aligned_plan(model, ns, n, SCHEDULE[src.split("_")[1]], plan_file,
                                            stages=2 * n if two else 0)
                        print(f"  {model} x{n} {v}: {note}", flush=True)
                        if not note.startswith("rannc's"):
                            moved.add((model, n, v))
                    if v == "rannc_zbv":  # interleaved_1f1b's stages, in a V
                        extra = [f"--plan-file={v_plan(plan_file, tmp / f'plan_{model}_{n}_zbv.json')}"]
                    if v.startswith("pipe"):
                        bounds, whole = stage_bounds(plan_file, n_layers(model, a))
                        extra.append("--bounds=" + ",".join(map(str, bounds)))
                        if not whole or (model, n, src) in moved:
                            split_layer.add((model, n, v))
                        if rep == 0:
                            print(f"  {model} x{n} {v}: layer bounds {bounds} from {src}"
                                  f"{'' if whole else ' (rannc cut a layer in two: stages NOT identical)'}")
                    pm.launch([mpiexec, "-n", str(n), *me, "--worker", v, "--model", model,
                               "--label", label, "--out", str(tmp), f"--steps={a.steps}",
                               f"--warmup={a.warmup}", f"--microbatches={a.microbatches}",
                               *(["--size-sync"] if a.size_sync else []),
                               *model_args(model, a), *extra], a.timeout)
                    rows = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{label}.rank*.json"))]
                    results.setdefault((model, n, v), []).append(rows)
            if rep < a.repeats - 1:  # a run cut short by its caller's time still reports
                print(f"\nafter round {rep + 1} of {a.repeats}:", flush=True)
                report(a, cases, variants, results, split_layer | moved, final=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(a, cases, variants, results, split_layer | moved)


def report(a: argparse.Namespace, cases: list[tuple[str, int]], variants: tuple[str, ...],
           results: dict[tuple[str, int, str], list[list[dict[str, Any]]]],
           split_layer: set[tuple[str, int, str]], final: bool = True) -> None:
    def speed(key: tuple[str, int, str]) -> float:
        return statistics.median(runs[0]["samples_s"] for runs in results[key])

    head = ["model", "ranks", "variant", "stages x replicas", "microbatches", "samples/s (median)",
            "all repeats", "rannc row / this row", "paired ratio (median, range)", "loss, last step",
            "per-rank peak MB (median)", "per-rank CPU ms/step (median)",
            "per-rank page faults/step (median)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    bad = []
    for model, n in cases:
        for v in variants:
            key = (model, n, v)
            first = results[key][0][0]
            # (the counterpart, else rannc 1F1B, else the first variant run: a run of
            # variants without rannc_auto or rannc_1f1b still reports)
            fallback = "rannc_1f1b" if "rannc_1f1b" in variants else variants[0]
            ref = (model, n, COUNTERPART[v] if COUNTERPART[v] in variants else fallback)
            ratio = speed(ref) / speed(key)
            # repeat i of both rows ran in the same round: their ratio is taken pair by pair, so
            # that load drifting over the run (a shared machine) cancels within each pair
            pairs = sorted(a[0]["samples_s"] / b[0]["samples_s"]
                           for a, b in zip(results[ref], results[key], strict=True))
            paired = (f"{statistics.median(pairs):.2f} ({pairs[0]:.2f} to {pairs[-1]:.2f})"
                      if ref[2] != v else "")
            loss = first["losses"][-1]
            ref_loss = results[ref][0][0]["losses"][-1]
            # pipelining runs rannc's stages and microbatches, so it must train the same thing;
            # the other rows may differ by BatchNorm statistics over other row groups
            if v.startswith("pipe") and abs(loss - ref_loss) > LOSS_RTOL * abs(ref_loss):
                bad.append(f"{model} x{n} {v}: loss {loss:.6f} vs {ref[2]} {ref_loss:.6f}")
            peaks = [statistics.median(runs[r]["peak_mb"] for runs in results[key]) for r in range(n)]
            cpus = [statistics.median(runs[r].get("cpu_ms_step", 0.0) for runs in results[key])
                    for r in range(n)]
            faults = [statistics.median(runs[r].get("faults_step", 0.0) for runs in results[key])
                      for r in range(n)]
            reps = ", ".join(f"{runs[0]['samples_s']:.1f}" for runs in results[key])
            over = pm.cores_note(n)
            lines.append("| " + " | ".join([
                model, f"{n}{over}", NAMES[v], first["layout"] + (
                    "*" if key in split_layer else ""), str(first["microbatches"]),
                f"{speed(key):.2f}", reps, f"{ratio:.2f}" if ref[2] != v else "1 (reference)", paired,
                f"{loss:.5f}", " / ".join(f"{p:.0f}" for p in peaks),
                " / ".join(f"{c:.0f}" for c in cpus), " / ".join(f"{f:.0f}" for f in faults)]) + " |")
    print("\n" + "\n".join(lines), flush=True)
    if not final:
        return
    if split_layer:
        print("\n\\* rannc's own cut fell inside a layer; these rows run its plan with the cut moved "
              "to the nearest layer boundary (rannc) and the same layer split (pipelining)")
    for model, n in cases:
        for v in variants:
            print(f"{model} x{n} {NAMES[v]}: losses " + ", ".join(
                f"{x:.5f}" for x in results[(model, n, v)][0][0]["losses"]))
    print("loss check: " + ("every pipelining run agrees with rannc on the same stages within "
                            f"{LOSS_RTOL:g} relative" if not bad else "MISMATCH " + "; ".join(bad)))
    if a.plot:
        plot(a.plot, cases, variants, speed)
    if bad:
        sys.exit(1)


def plot(path: str, cases: list[tuple[str, int]], variants: tuple[str, ...], speed: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide = max(3.2, 0.6 * len(variants))  # the new schedules' seven bars need the room
    fig, axes = plt.subplots(1, len(cases), figsize=(wide * len(cases), 4.4), squeeze=False)
    for ax, (model, n) in zip(axes[0], cases, strict=True):
        vals = [speed((model, n, v)) for v in variants]
        ax.bar(range(len(variants)), vals, color=["C0" if v.startswith("rannc") else "C1"
                                                  if v.startswith("pipe") else "C2" for v in variants])
        ax.set_xticks(range(len(variants)), [NAMES[v].replace("pipelining Schedule", "pipe ").replace(
            " (2 stages per rank)", ", 2/rank") for v in variants], fontsize=7, rotation=35, ha="right")
        ax.set_title(f"{model}, {n} ranks{pm.cores_note(n)}", fontsize=9)
        ax.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The sizes of the BERT-like and ResNet models `build` makes (also benchmarks/data_parallel.py's)."""
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--units", type=int, default=6)
    p.add_argument("--image", type=int, default=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny BERT, 2 ranks, 1 repeat, 3 variants")
    p.add_argument("--models", nargs="+", default=["bert", "resnet"], choices=["bert", "resnet", "standin"],
                   help="standin: --layers layers that sleep (benchmarks/stand_in.py), even stages")
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in NEW_VARIANTS
                                                      or v in ("rannc_1f1b", "pipe_1f1b")],
                   choices=VARIANTS, help="a subset (a pipelining variant needs its rannc one)")
    p.add_argument("--new-schedules", action="store_true",
                   help=f"the zero-bubble and interleaved comparison: variants {' '.join(NEW_VARIANTS)}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--malloc", choices=("default", "reuse"), default="default",
                   help="default: each variant's ranks as its users get them (rannc's host_malloc "
                        "'auto' reuses freed heap blocks on a CPU, the others run glibc's "
                        "defaults); reuse: every variant's ranks on glibc's thresholds raised as "
                        "rannc's 'reuse' raises them (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), "
                        "so the runtimes are compared on the same allocator")
    p.add_argument("--size-sync", action="store_true",
                   help="diagnostic: pipelining steps start with rannc's all-gather of row counts")
    add_model_args(p)
    p.add_argument("--t-f", type=float, default=10.0, help="standin: ms one layer sleeps in forward")
    p.add_argument("--t-b", type=float, default=10.0, help="standin: ms in its input gradient")
    p.add_argument("--t-w", type=float, default=10.0, help="standin: ms in its weight gradient")
    p.add_argument("--batch", type=int, default=0, help="global batch (0: 16 for BERT, 32 for ResNet)")
    p.add_argument("--plot", default="", help="PNG path for the bar plot")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--plan-file", help=argparse.SUPPRESS)
    p.add_argument("--bounds", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.variant = a.worker
        worker(a)
        return
    if a.smoke:
        a.models, a.ranks, a.repeats, a.steps, a.warmup = ["bert"], [2], 1, 2, 1
        a.vocab, a.hidden, a.layers, a.heads, a.seq, a.microbatches = 128, 32, 2, 2, 16, 2
        a.batch = a.batch or 8
        a.timeout = min(a.timeout, 180)  # a launch takes seconds: a hang shows its stacks early
    if a.new_schedules:
        a.variants = list(NEW_VARIANTS)
    a.batch_of = {"bert": a.batch or 16, "resnet": a.batch or 32, "standin": a.batch or 32}
    driver(a)


if __name__ == "__main__":
    main()
