"""Capacity: the largest BERT that rannc, DDP and an equal split can train on 4 ranks under a
per-rank memory limit (issue 8, study 3), by rannc's memory model, then one point measured.

    PYTHONPATH=. .venv/bin/python benchmarks/capacity.py           # 4 x V100-16GB, then the CPU check
    PYTHONPATH=. .venv/bin/python benchmarks/capacity.py --smoke   # tiny sizes, 2 ranks

Part 1 (no device runs). ``BertForPreTraining`` (vocabulary 30522, 4H intermediate, H/64 heads,
AdamW) on the ``meta`` device, captured once per (layers, hidden), for a fixed global batch and
sequence length. Three approaches, all judged by the memory model the planner uses
(``rannc.stage_dp.tables.stage_tables``: parameters + gradients + AdamW state, in-flight stage
inputs/outputs and kept activations of the schedule, recomputation where it frees memory, the
largest task's working bytes, ``mem_margin`` 0.1):

* ``rannc``: the planner (``plan_graph``, estimate oracle) with the device's memory; fits when it
  returns a plan.
* ``DDP``: the same planner forced to one stage replicated on every rank with one microbatch
  (``partition_num=1, microbatches=1, zero_stage=0``): every rank holds the whole model, its
  optimizer state and the activations of its rows (with one microbatch, recomputation frees
  nothing). ``DDP + ZeRO-1``: the same with ``zero_stage=1`` (each rank keeps 1/N of the
  AdamW state, as DeepSpeed's ZeRO stage 1 or ``ZeroRedundancyOptimizer``).
* ``rannc, ZeRO-1 off``: the planner with ``zero_stage=0`` (``rannc``: the default "auto",
  which plans ZeRO-1 only when nothing fits without it).
* ``equal split``: 4 stages, one rank each, cut between encoder layers so that each holds L/4
  of them (embeddings on the first, the heads on the last), no replicas; its memory is
  ``stage_tables`` on those 4 stages, for GPipe (every microbatch in flight) and 1F1B (stage i
  holds min(4 - i, m)), recomputation allowed, the best microbatch count of 1, 2, 4, ...
  Layers in multiples of 4.

For each hidden size, the largest layer count that fits is found from two small captures (the
need is close to affine in layers), then confirmed and walked up or down one step at a time.

Part 2 (measured, CPU). A small per-rank limit (``--cpu-limit-gb``) and a small BERT family; the
largest each of rannc and DDP plans for under it is trained for a few steps on 4 ranks
(``mpiexec``, gloo): rannc with ``mem_limit_gb`` set, DDP as ``DistributedDataParallel``. Per rank:
the forecast (the stage's predicted memory for rannc; the DDP need for DDP) next to the measured
peak resident memory during steps 2+ above the baseline before the model is built (``VmHWM``, as
in ``benchmarks/pipeline_memory.py``). Every rank builds the whole model before rannc keeps its
stage, so the first step is not compared.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_memory as pm  # noqa: E402  (its launcher and VmHWM helpers)

ROOT = Path(__file__).resolve().parents[1]
APPROACHES = ("rannc", "rannc, ZeRO-1 off", "DDP", "DDP + ZeRO-1", "equal split")
# the planner's options per approach: rannc as a user gets it (zero_stage "auto": ZeRO-1 when
# nothing fits without it), DDP as one stage on every rank, each with ZeRO-1 forced off or on
FORCED: dict[str, dict[str, Any]] = {
    "rannc": {}, "rannc, ZeRO-1 off": dict(zero_stage=0),
    "DDP": dict(partition_num=1, microbatches=1, zero_stage=0),
    "DDP + ZeRO-1": dict(partition_num=1, microbatches=1, zero_stage=1)}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")


@dataclass
class Captured:
    graph: Any
    atomic: Any
    costs: Any
    params: int  # distinct parameters of the model


class Bert:
    """BertForPreTraining of a given width on the meta device, captured once per size."""

    def __init__(self, batch: int, seq: int, vocab: int) -> None:
        self.batch, self.seq, self.vocab = batch, seq, vocab
        self._cache: dict[tuple[int, int], Captured] = {}

    def config(self, layers: int, hidden: int) -> Any:
        from transformers import BertConfig

        return BertConfig(vocab_size=self.vocab, hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                          max_position_embeddings=max(512, self.seq))

    def inputs(self, device: str) -> dict[str, Any]:
        import torch

        ids = torch.zeros(self.batch, self.seq, dtype=torch.long, device=device)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=ids,
                    labels=ids, next_sentence_label=torch.zeros(self.batch, dtype=torch.long, device=device))

    def get(self, layers: int, hidden: int) -> Captured:
        if (layers, hidden) not in self._cache:
            import torch
            from transformers import BertForPreTraining

            from rannc.atomic.components import atomic_components
            from rannc.graph.capture import capture
            from rannc.profile.estimate import GraphCosts

            with torch.device("meta"):
                model = BertForPreTraining(self.config(layers, hidden))
            graph = capture(model, (), self.inputs("meta")).graph
            atomic = atomic_components(graph)
            self._cache[(layers, hidden)] = Captured(graph, atomic, GraphCosts.of(graph, atomic),
                                                     sum(p.numel() for p in model.parameters()))
        return self._cache[(layers, hidden)]


# -- what each approach needs ------------------------------------------------------------------
def fits_planner(c: Captured, cluster: Any, batch: int, limit_gb: float, **forced: Any) -> Any:
    """The plan rannc's planner makes under `limit_gb` (with `forced` options), or None."""
    import rannc
    from rannc.planner import PlanInfeasibleError, plan_graph

    try:
        return plan_graph(c.graph, c.atomic, cluster, rannc.Config(mem_limit_gb=limit_gb, **forced),
                          batch_size=batch, costs=c.costs)
    except PlanInfeasibleError:
        return None


def need_planner(c: Captured, cluster: Any, batch: int, **forced: Any) -> float:
    """Bytes per device the planner says the model needs at least (mem_margin included)."""
    import rannc
    from rannc.planner import PlanInfeasibleError, plan_graph

    try:
        plan_graph(c.graph, c.atomic, cluster, rannc.Config(mem_limit_gb=1e-9, **forced),
                   batch_size=batch, costs=c.costs)
    except PlanInfeasibleError as e:
        return float(e.needed_bytes)
    return 0.0


def need_equal(c: Captured, cluster: Any, batch: int, layers: int, stages: int) -> float:
    """Bytes per device the equal split needs (mem_margin included): the best microbatch count
    and schedule of its largest stage, by the planner's memory model."""
    import numpy as np

    import rannc
    from rannc.planner import EstimateOracle, param_names_of
    from rannc.stage_dp.memory import MemoryModel
    from rannc.stage_dp.search import microbatch_counts
    from rannc.stage_dp.tables import BlockIO, batch_per_replica, stage_tables

    cfg = rannc.Config()
    block_of, s = [], 0
    for comp in range(len(c.atomic.components)):
        idx = [int(m.group(1)) for n in param_names_of(c.graph, c.atomic, [comp])
               if (m := _LAYER.search(n))]
        if idx:
            s = max(s, idx[0] * stages // layers)  # components without layer parameters stay put
        block_of.append(s)
    io = BlockIO.of(c.graph, c.atomic, block_of)
    # as the planner: eager schedules keep every microbatch's stage inputs when a float batch
    # output (the logits) may also get a gradient
    late = any(v is not None and c.graph.values[v].batch_dim is not None
               and c.graph.values[v].dtype.startswith(("float", "bfloat")) for v in c.graph.outputs)
    mem = MemoryModel(opt_param_factor=2.0, limit=math.inf, checkpointing=cfg.checkpointing)
    spec = cluster.devices[0]
    oracle = EstimateOracle(c.costs, cluster)
    best = math.inf
    for m in microbatch_counts(cfg, batch):
        prof = oracle.block_profile(block_of, [batch_per_replica(batch, 1, m, 1)])
        for sched in ("gpipe", "1f1b"):
            worst = 0.0
            for i in range(stages):
                n_in = m if sched == "gpipe" else min(stages - i, m)
                saved = m if sched != "gpipe" and late else 0
                tab = stage_tables(prof, io, mem, batch_size=batch, devices=1, copies=1, microbatches=m,
                                   link_bw=spec.link_bandwidth, allreduce_bw=spec.link_bandwidth,
                                   inflight=n_in, saved_inputs=saved, world=stages)
                worst = max(worst, float(tab.memory_min[i, i, 1]))
            best = min(best, worst)
    return float(best / (1.0 - cfg.mem_margin)) if np.isfinite(best) else math.inf


# -- the search ---------------------------------------------------------------------------------
def largest(bert: Bert, approach: str, hidden: int, cluster: Any, limit_gb: float,
            probe: tuple[int, int], max_layers: int, log: list[str]) -> tuple[int, Any]:
    """The largest layer count `approach` fits at `hidden`, and its plan (rannc/DDP) or None."""
    stages, step = cluster.size, cluster.size if approach == "equal split" else 1
    cap = limit_gb * 1e9

    def need(L: int) -> float:
        c = bert.get(L, hidden)
        if approach in FORCED:
            return need_planner(c, cluster, bert.batch, **FORCED[approach])
        return need_equal(c, cluster, bert.batch, L, stages)

    def fits(L: int) -> Any:
        c = bert.get(L, hidden)
        if approach == "equal split":
            return need(L) <= cap or None
        return fits_planner(c, cluster, bert.batch, limit_gb, **FORCED[approach])

    lo, hi = (max(step, p - p % step) for p in probe)
    n_lo, n_hi = need(lo), need(hi)
    slope = (n_hi - n_lo) / (hi - lo)
    guess = lo + (cap - n_lo) / slope if slope > 0 else max_layers
    L = int(min(max_layers, max(step, guess)) // step * step)
    log.append(f"  {approach} H{hidden}: need {n_lo / 1e9:.2f} GB at L{lo}, {n_hi / 1e9:.2f} GB at "
               f"L{hi}; first guess L{L}")
    # gallop from the guess to a bracket [ok, bad), then bisect it (in units of `step`)
    plans: dict[int, Any] = {}

    def ok(n: int) -> bool:
        plans[n] = fits(n * step)
        return bool(plans[n])

    g = L // step
    if ok(g):
        good, d = g, 1
        while good + d <= max_layers // step and ok(good + d):
            good, d = good + d, 2 * d
        bad = min(good + d, max_layers // step + 1)
    else:
        bad, d = g, 1
        while bad - d >= 1 and not ok(bad - d):
            bad, d = bad - d, 2 * d
        good = max(0, bad - d)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good * step, plans.get(good)


def params_of(bert: Bert, layers: int, hidden: int) -> int:
    import torch
    from transformers import BertForPreTraining

    if layers == 0:
        return 0
    with torch.device("meta"):
        return sum(p.numel() for p in BertForPreTraining(bert.config(layers, hidden)).parameters())


def describe(plan: Any) -> str:
    if plan is None:
        return "-"
    zero = ", ZeRO-1" if plan.zero_stage else ""
    reps = [st.replicas for st in plan.stages]
    shape = f"{len(reps)} x {reps[0]}" if len(set(reps)) == 1 else f"replicas {reps}"
    rec = max(st.recompute for st in plan.stages)
    return f"{shape}, {plan.microbatches} mb, {plan.schedule}, recompute up to {rec:.0%}{zero}"


def model_part(a: argparse.Namespace) -> list[dict[str, Any]]:
    import rannc

    bert = Bert(a.batch, a.seq, a.vocab)
    cluster = rannc.Cluster.homogeneous(a.device, n=a.np, per_node=a.np)
    limit_gb = a.mem_gb or cluster.devices[0].memory_bytes / 1e9
    rows: list[dict[str, Any]] = []
    for hidden in a.hidden:
        for approach in APPROACHES:
            t0 = time.perf_counter()
            log: list[str] = []
            L, plan = largest(bert, approach, hidden, cluster, limit_gb, tuple(a.probe), a.max_layers, log)
            print("\n".join(log) + f" -> L{L} ({time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append(dict(hidden=hidden, approach=approach, layers=L, params=params_of(bert, L, hidden),
                             plan=describe(plan) if approach.startswith("rannc") else ""))
    best = {ap: max(r["params"] for r in rows if r["approach"] == ap) for ap in APPROACHES}
    print(f"\n{a.np} x {a.device} ({limit_gb:.2f} GB each, mem_margin 0.1), BertForPreTraining "
          f"vocab {a.vocab}, global batch {a.batch} x {a.seq}, AdamW, estimate oracle\n")
    head = ["hidden", "approach", "largest layers", "parameters (M)", "vs DDP", "rannc plan"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        ddp = next(x["params"] for x in rows if x["hidden"] == r["hidden"] and x["approach"] == "DDP")
        vs = f"{r['params'] / ddp:.2f}x" if ddp else "DDP fits none"
        lines.append("| " + " | ".join([str(r["hidden"]), r["approach"], str(r["layers"]),
                                        f"{r['params'] / 1e6:.1f}", vs, r["plan"] or ""]) + " |")
    print("\n".join(lines))
    print("\nlargest over the grid: " + ", ".join(f"{ap} {best[ap] / 1e6:.0f} M" for ap in APPROACHES)
          + f"; rannc / DDP {best['rannc'] / max(1, best['DDP']):.2f}x, DDP + ZeRO-1 / DDP "
          f"{best['DDP + ZeRO-1'] / max(1, best['DDP']):.2f}x, rannc / equal split "
          f"{best['rannc'] / max(1, best['equal split']):.2f}x")
    if a.plot:
        plot(a.plot, rows, a)
    return rows


def plot(path: str, rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(APPROACHES)
    for j, ap in enumerate(APPROACHES):
        vals = [next(r["params"] for r in rows if r["hidden"] == h and r["approach"] == ap) / 1e9
                for h in a.hidden]
        ax.bar([i + j * width for i in range(len(a.hidden))], vals, width, label=ap)
    ax.set_xticks([i + width for i in range(len(a.hidden))], [f"hidden {h}" for h in a.hidden])
    ax.set_ylabel("largest BERT that fits (billion parameters)")
    ax.set_title(f"{a.np} x {a.device}, global batch {a.batch} x {a.seq}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# -- part 2: measured on this machine -------------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import BertForPreTraining

    import rannc
    from rannc import dist as rdist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rdist.init_process_group(timeout_s=900)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    bert = Bert(a.batch, a.seq, a.vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, a.vocab, (a.batch, a.seq), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                 labels=ids.clone(), next_sentence_label=torch.randint(0, 2, (a.batch,), generator=g))
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world
    batch = {k: v[lo:hi].contiguous() for k, v in batch.items()}
    base_kb = pm.status_kb("VmRSS")
    torch.manual_seed(0)
    model = BertForPreTraining(bert.config(a.layers, a.hidden_one))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if a.worker == "rannc":
        run: Any = rannc.RaNNCModule(model, opt, mem_limit_gb=a.limit_gb)
    else:
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
    peak_kb, losses = 0, []
    for step in range(a.steps):
        loss = run(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
        if step == 0:
            dist.barrier()
            pm.reset_peak()
    peak_kb = pm.status_kb("VmHWM") - base_kb
    forecast = None
    if a.worker == "rannc":
        st = run.plan.stage_of_rank(rank)
        forecast = st.predicted.get("memory_bytes")
        layout = describe(run.plan)
    else:
        layout = f"1 x {world}"
    Path(a.out, f"{a.worker}.rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, peak_mb=peak_kb / 1024, forecast_mb=forecast / 2**20 if forecast else None,
        layout=layout, losses=losses)))
    del run  # a DDP wrapper, before the process group goes (`pm.shutdown`)
    pm.shutdown()


def cpu_part(a: argparse.Namespace) -> None:
    import rannc
    from rannc.profile.device import measure_local_device

    bert = Bert(a.cpu_batch, a.cpu_seq, a.cpu_vocab)
    cluster = rannc.Cluster.homogeneous(measure_local_device(), n=a.np, per_node=a.np)
    found: dict[str, tuple[int, Any]] = {}
    for approach in ("rannc", "DDP"):
        log: list[str] = []
        found[approach] = largest(bert, approach, a.cpu_hidden, cluster, a.cpu_limit_gb,
                                  tuple(a.cpu_probe), a.max_layers, log)
        print("\n".join(log) + f" -> L{found[approach][0]}", flush=True)
    ddp_need = need_planner(bert.get(found["DDP"][0], a.cpu_hidden), cluster, bert.batch,
                            **FORCED["DDP"]) * 0.9  # the prediction, margin off
    mpiexec = pm.mpiexec()
    tmp = Path(tempfile.mkdtemp(prefix="rannc_capacity_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    rows = []
    try:
        for approach in ("rannc", "DDP"):
            L = found[approach][0]
            pm.launch([mpiexec, "-n", str(a.np), *me, "--worker", approach, "--out", str(tmp),
                       f"--layers={L}", f"--hidden-one={a.cpu_hidden}", f"--batch={a.cpu_batch}",
                       f"--seq={a.cpu_seq}", f"--vocab={a.cpu_vocab}", f"--limit-gb={a.cpu_limit_gb}",
                       f"--steps={a.steps}"], a.timeout)
            for p in sorted(tmp.glob(f"{approach}.rank*.json")):
                r = json.loads(p.read_text())
                fc = r["forecast_mb"] if approach == "rannc" else ddp_need / 2**20
                size = f"L{L} H{a.cpu_hidden} ({params_of(bert, L, a.cpu_hidden) / 1e6:.1f} M)"
                rows.append([approach, size,
                             r["layout"], str(r["rank"]), f"{a.cpu_limit_gb * 1e3 / 1.048576:.0f}",
                             f"{fc:.0f}", f"{r['peak_mb']:.0f}", f"{r['peak_mb'] / fc:.2f}",
                             ", ".join(f"{x:.3f}" for x in r["losses"])])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nmeasured on this machine: {a.np} ranks (gloo, 1 thread each), per-rank limit "
          f"{a.cpu_limit_gb} GB, BertForPreTraining vocab {a.cpu_vocab}, global batch "
          f"{a.cpu_batch} x {a.cpu_seq}, AdamW\n")
    head = ["approach", "model", "layout", "rank", "limit MiB", "forecast MiB",
            "measured peak MiB (steps 2+)", "measured / forecast", "losses"]
    print("\n".join(["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
                    + ["| " + " | ".join(r) + " |" for r in rows]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 ranks")
    p.add_argument("--device", default="V100-16GB", help="a rannc.KNOWN_DEVICES name")
    p.add_argument("--mem-gb", type=float, default=0.0, help="per-rank limit (0: the device's memory)")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 3072, 4096])
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--probe", type=int, nargs=2, default=[4, 8], help="two layer counts to extrapolate from")
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--plot", default="")
    p.add_argument("--skip-cpu", action="store_true", help="only part 1")
    p.add_argument("--skip-model", action="store_true", help="only part 2")
    p.add_argument("--cpu-limit-gb", type=float, default=0.2)
    p.add_argument("--cpu-hidden", type=int, default=256)
    p.add_argument("--cpu-batch", type=int, default=16)
    p.add_argument("--cpu-seq", type=int, default=64)
    p.add_argument("--cpu-vocab", type=int, default=8192)
    p.add_argument("--cpu-probe", type=int, nargs=2, default=[4, 8])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--worker", choices=("rannc", "DDP"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hidden-one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--limit-gb", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.worker:
        worker(a)
        return
    if a.smoke:
        a.np, a.hidden, a.batch, a.seq, a.vocab, a.probe, a.max_layers = 2, [64], 8, 16, 512, [2, 4], 12
        a.mem_gb = 0.006
        # (a CPU rank's forecast holds its overhead beyond tensors: about 20 MB, rannc.hostmem)
        a.cpu_limit_gb, a.cpu_hidden, a.cpu_batch, a.cpu_seq, a.cpu_vocab = 0.03, 64, 8, 16, 512
        a.cpu_probe, a.steps = [2, 4], 2
    if not a.skip_model:
        model_part(a)
    if not a.skip_cpu:
        cpu_part(a)


if __name__ == "__main__":
    main()
