"""Issue 8, study 5: rannc with one stage vs plain PyTorch on BERT-Large on one GPU, fp32 and bf16.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_study.py --plot docs/gpu_study.png  # one CUDA GPU
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_study.py --smoke   # tiny BERT on CPU: seconds

1. Throughput. `BertForPreTraining` (24 layers, hidden 1024, 16 heads, seq 128, batch 32 by
   default) trained with AdamW as plain PyTorch and through `rannc.RaNNCModule` in one process
   (world size 1: the captured graph runs as one stage), two copies of the same model on the
   same batch, iterations alternating in ABBA order after a warm-up (`single_stage_overhead.
   alternate`, synchronising the GPU around every timed iteration). bf16 runs the forward of
   both under `torch.autocast(device, torch.bfloat16)`. Prints samples/s of each, the ratio
   rannc / plain, model FLOP/s utilisation (MFU) and the peak allocated GPU memory of each.
2. Prediction vs measurement, per dtype on the graph rannc captured for it. The planner
   (`plan_graph`, estimate oracle) splits the graph into 1, 2 and 4 stages (`partition_num`,
   one replica each, one microbatch, no recomputation) on the detected GPU's `DeviceSpec` from
   rannc's table (on a CPU or an unknown GPU: the spec `measure_local_device()` measures).
   For every stage: the plan's forward_s + backward_s (which adds the stage's input/output
   transfer at link bandwidth), the estimate oracle's compute time on the table spec and on
   the measured local spec (what `rannc.plan` uses by default), and the time the measure
   oracle (`MeasureOracle`: CUDA events, median of many runs) takes to run that stage's graph
   forward and backward on this device. The estimate prices tasks with half-precision
   outputs (autocast) at `DeviceSpec.flops_half`, the others at `DeviceSpec.flops` (fp32).

Model FLOPs per iteration, both printed:
- formula: 6 * N * tokens + 12 * L * h * s^2 * batch (Megatron-LM, Narayanan et al. 2021;
  PaLM appendix B): forward and backward of every weight (N distinct parameters, embeddings
  included, tokens = batch * s) plus the two attention products (Q K^T and P V);
- graph: 3 x the forward FLOPs of the matrix products and attention tasks of rannc's captured
  graph, as `rannc.profile.estimate` counts them (2 m n k per product; backward twice forward).
MFU = model FLOPs / median iteration seconds / peak FLOP/s, where the peak is the dense figure
for the dtype the matrix products run in: bf16 `DeviceSpec.flops_half`; fp32 `DeviceSpec.flops`
(non-tensor), or the TF32 tensor-core peak when `torch.backends.cuda.matmul.allow_tf32` is on
(`--tf32`; PyTorch's default is off). rannc's table holds SXM figures: an H100 PCIe is
measured against the SXM peak. On a CPU (the smoke run) the peak is the fp32 matrix
product speed `measure_local_device()` measures, so its MFU is not comparable to a GPU's.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining

sys.path.insert(0, str(Path(__file__).resolve().parent))
import single_stage_overhead as sso  # noqa: E402  (step_fn, alternate: the ABBA timing)

import rannc  # noqa: E402
from rannc.config import Config  # noqa: E402
from rannc.graph.capture import flatten_inputs  # noqa: E402
from rannc.graph.task_graph import TaskGraph  # noqa: E402
from rannc.planner import plan_graph  # noqa: E402
from rannc.plans import Plan  # noqa: E402
from rannc.profile.device import KNOWN_DEVICES, Cluster, DeviceSpec, measure_local_device  # noqa: E402
from rannc.profile.estimate import _ATTN_OPS, _MATMUL_OPS, GraphCosts  # noqa: E402
from rannc.profile.measure import MeasureOracle, MeasureSettings, _cpu_model  # noqa: E402

TF32_DENSE = {"H100": 494e12, "H200": 494e12, "A100-40GB": 156e12, "A100-80GB": 156e12}
GiB = float(1 << 30)


SMOKE_BERT = {"layers": 2, "hidden": 64, "seq": 16, "batch": 4}  # --smoke's model and batch


def bert_args(p: argparse.ArgumentParser) -> None:
    """The model and batch `bert_pair` builds (BERT-Large, 32 x 128 by default)."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bert_args(p)
    p.add_argument("--iters", type=int, default=20, help="timed iterations of each variant")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="splits to predict")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matrix products in fp32")
    p.add_argument("--measure-seconds", type=float, default=2.0, help="measure oracle, per stage")
    p.add_argument("--plot", default=None, help="PNG of predicted vs measured stage times")
    p.add_argument("--smoke", action="store_true", help="2 x 64 BERT, 2 iterations: seconds")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE_BERT, iters=2)
        a.stages, a.measure_seconds = [1, 2], 0.2
    return a


@dataclass(frozen=True, slots=True)
class Throughput:
    dtype: str
    variant: str
    seconds: float  # median per iteration
    peak_bytes: float  # allocator peak over its iterations (0 on CPU)
    step_bytes: float  # that peak above what was allocated when its iteration began


@dataclass(frozen=True, slots=True)
class StageTime:
    dtype: str
    stages: int
    stage: int
    modules: str
    planned: float  # seconds, the plan's forward_s + backward_s (stage input/output transfer too)
    predicted_table: float | None  # seconds, estimate oracle on rannc's table spec for this GPU
    predicted_local: float  # seconds, estimate oracle on measure_local_device()
    measured: float  # seconds, measure oracle


def table_spec(dev: torch.device) -> DeviceSpec | None:
    """rannc's DeviceSpec for this GPU: the table entry whose model is in the device name and
    whose memory is nearest (A100-40GB vs -80GB). None on a CPU or an unknown GPU."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev).upper()
    mem = torch.cuda.get_device_properties(dev).total_memory
    found = [s for n, s in KNOWN_DEVICES.items() if n.split("-")[0] in name]
    return min(found, key=lambda s: abs(s.memory_bytes - mem), default=None)


def peak_flops(dtype: str, table: DeviceSpec | None, local: DeviceSpec) -> tuple[float, str]:
    """Dense peak FLOP/s of the matrix products at `dtype`, and where it comes from."""
    if table is None:
        return local.flops, f"{local.name} measured fp32 matmul"
    if dtype == "bf16":
        return table.flops_half, f"{table.name} bf16 dense"
    if torch.backends.cuda.matmul.allow_tf32 and table.name in TF32_DENSE:
        return TF32_DENSE[table.name], f"{table.name} tf32 dense"
    return table.flops, f"{table.name} fp32"


def formula_flops(cfg: BertConfig, n_params: int, batch: int, seq: int) -> float:
    return 6.0 * n_params * batch * seq + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq**2 * batch


def graph_flops(graph: TaskGraph, costs: GraphCosts, batch: int) -> float:
    products = np.array([bool(_MATMUL_OPS.match(t.op) or _ATTN_OPS.match(t.op)) for t in graph.tasks])
    fwd = costs.flops[:, 0] + costs.flops[:, 1] * batch
    return 3.0 * float(fwd[products].sum())


def machine_line(dev: torch.device) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    if dev.type == "cuda":
        what = f"{torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda}"
    else:
        what = f"cpu ({_cpu_model()}), torch threads {torch.get_num_threads()}"
    tf32 = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
    return (f"machine: {what}; torch {torch.__version__}; date {datetime.date.today()}; commit "
            f"{commit}; TF32 matmul {tf32} (float32_matmul_precision "
            f"{torch.get_float32_matmul_precision()})")


def throughput(dtype: str, runs: dict[str, Callable[[], None]], iters: int,
               dev: torch.device) -> list[Throughput]:
    """Median seconds per iteration of each run, alternating, with its GPU memory peak."""
    cuda = dev.type == "cuda"
    peak = dict.fromkeys(runs, 0.0)
    step = dict.fromkeys(runs, 0.0)

    def tracked(k: str, f: Callable[[], None]) -> Callable[[], None]:
        if not cuda:
            return f

        def g() -> None:
            start = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            f()
            top = torch.cuda.max_memory_allocated(dev)
            peak[k], step[k] = max(peak[k], top), max(step[k], top - start)
        return g

    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    times = sso.alternate({k: tracked(k, f) for k, f in runs.items()}, iters, sync=sync)
    return [Throughput(dtype, k, statistics.median(v), peak[k], step[k]) for k, v in times.items()]


def stage_times(dtype: str, wrapped: rannc.RaNNCModule, batch: dict[str, torch.Tensor],
                dev: torch.device, table: DeviceSpec | None, local: DeviceSpec,
                stage_counts: list[int],
                settings: MeasureSettings) -> tuple[list[StageTime], GraphCosts, TaskGraph]:
    """Predicted (planner, estimate oracle) and measured (measure oracle) fwd+bwd of every stage
    of the 1, 2, 4, ... stage splits of the graph rannc captured for the last forward."""
    dep = list(wrapped._deployments.values())[-1]  # captured under this dtype's autocast
    cap, atomic = dep.captured, dep.atomic
    costs = GraphCosts.of(cap.graph, atomic)
    spec = table or local
    leaves, _ = flatten_inputs((), batch)
    oracle = MeasureOracle(cap, atomic, wrapped.module, leaves, dev, costs, spec, settings=settings)
    b = next(iter(batch.values())).shape[0]
    out = []
    for n in stage_counts:
        cfg = Config(partition_num=n, replicas=[1] * n, microbatches=1, checkpointing="off",
                     schedule="gpipe", opt_param_factor=2.0)
        plan = plan_graph(cap.graph, atomic, Cluster.homogeneous(spec, n=n, per_node=n), cfg,
                          batch_size=b, costs=costs)
        stage_of = stage_of_components(plan, len(atomic.components))
        meas = oracle.block_profile(stage_of, [b])
        est_local = costs.block_profile(local, stage_of, [b])
        est_table = costs.block_profile(table, stage_of, [b]) if table else None
        for st in plan.stages:
            s = st.index
            out.append(StageTime(
                dtype, n, s, st.modules, st.predicted["forward_s"] + st.predicted["backward_s"],
                None if est_table is None else float(est_table.fwd[s, 0] + est_table.bwd[s, 0]),
                float(est_local.fwd[s, 0] + est_local.bwd[s, 0]), float(meas.fwd[s, 0] + meas.bwd[s, 0])))
    if oracle.fallbacks:
        print(f"measure oracle fell back to the estimate for {oracle.fallbacks}")
    return out, costs, cap.graph


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def ratio(a: float, b: float | None) -> str:
    return "-" if b is None or b <= 0 else f"{a / b:.2f}"


def plot(path: str, rows: list[StageTime], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4))
    series = [("estimate, rannc table spec", [r.predicted_table or 0.0 for r in rows]),
              ("estimate, measured local spec", [r.predicted_local for r in rows]),
              ("measured (measure oracle)", [r.measured for r in rows])]
    for i, (label, ys) in enumerate(series):
        if not any(ys):  # no table spec for this device
            continue
        ax.bar(x + (i - 1) * 0.27, [y * 1e3 for y in ys], 0.27, label=label)
    ax.set_xticks(x, [f"{r.dtype} {r.stages}st s{r.stage}" for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("forward + backward, ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bert_pair(layers: int, hidden: int, seq: int, batch_size: int, dev: torch.device,
              ) -> tuple[BertConfig, nn.Module, torch.optim.Optimizer, rannc.RaNNCModule,
                         torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The same BertForPreTraining twice (seed 0), plain and wrapped by rannc, each with its
    AdamW, and one pre-training batch: what gpu_study.py and gpu_profile.py compare."""
    cfg, plain, batch = bert_model(layers, hidden, seq, batch_size, dev)
    inner = copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_w = torch.optim.AdamW(inner.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(inner, opt_w)
    return cfg, plain, opt_p, wrapped, opt_w, batch


def bert_model(layers: int, hidden: int, seq: int, batch_size: int, dev: torch.device,
               ) -> tuple[BertConfig, nn.Module, dict[str, torch.Tensor]]:
    """A BertForPreTraining (seed 0) and one pre-training batch for it."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                     max_position_embeddings=max(512, seq))
    model = BertForPreTraining(cfg).to(dev)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq), device=dev)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                 next_sentence_label=torch.zeros(batch_size, dtype=torch.long, device=dev))
    return cfg, model, batch


def stage_of_components(plan: Plan, n_components: int) -> list[int]:
    """Per atomic component, the index of the plan's stage holding it."""
    stage_of = [0] * n_components
    for st in plan.stages:
        for c in st.components:
            stage_of[c] = st.index
    return stage_of


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg, plain, opt_p, wrapped, opt_w, batch = bert_pair(a.layers, a.hidden, a.seq, a.batch, dev)
    n_params = sum(p.numel() for p in plain.parameters())
    local, table = measure_local_device(), table_spec(dev)
    print(machine_line(dev))
    print(f"BERT L{a.layers} H{a.hidden} A{cfg.num_attention_heads}, {n_params / 1e6:.1f} M "
          f"parameters, batch {a.batch} x seq {a.seq}, AdamW, {a.iters} alternating iterations per "
          f"variant; device {dev}; rannc spec {table.name if table else '-'}; measured local "
          f"spec {local.flops / 1e12:.2f} TFLOP/s fp32 matmul, {local.mem_bandwidth / 1e9:.0f} GB/s")

    results: list[Throughput] = []
    stages: list[StageTime] = []
    flops: dict[str, tuple[float, float]] = {}
    settings = MeasureSettings(max_seconds=a.measure_seconds)
    for dtype in a.dtypes:
        ac = torch.bfloat16 if dtype == "bf16" else None
        runs = {"plain": sso.step_fn(plain, opt_p, batch, ac),
                "rannc": sso.step_fn(wrapped, opt_w, batch, ac)}
        results += throughput(dtype, runs, a.iters, dev)
        rows, costs, graph = stage_times(dtype, wrapped, batch, dev, table, local, a.stages, settings)
        stages += rows
        flops[dtype] = (formula_flops(cfg, n_params, a.batch, a.seq), graph_flops(graph, costs, a.batch))

    print("\n| dtype | variant | ms / iteration | samples / s | rannc / plain | model TFLOP/s "
          "(formula) | MFU formula | MFU graph | peak (method) | peak GiB | step peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        f_formula, f_graph = flops[r.dtype]
        peak, source = peak_flops(r.dtype, table, local)
        plain_s = next(x.seconds for x in results if x.dtype == r.dtype and x.variant == "plain")
        mem = (f"{r.peak_bytes / GiB:.2f} | {r.step_bytes / GiB:.2f}" if dev.type == "cuda"
               else "- | -")
        print(f"| {r.dtype} | {r.variant} | {r.seconds * 1e3:.1f} | {a.batch / r.seconds:.1f} | "
              f"{plain_s / r.seconds:.3f} | {f_formula / r.seconds / 1e12:.3g} | "
              f"{f_formula / r.seconds / peak:.1%} | {f_graph / r.seconds / peak:.1%} | "
              f"{peak / 1e12:.3g} TFLOP/s ({source}) | {mem} |")
    print("\nmodel FLOPs per iteration: " + "; ".join(
        f"{d}: formula {f:.4g}, graph {g:.4g} (graph / formula {g / f:.3f})"
        for d, (f, g) in flops.items()))

    print(f"\n| dtype | stages | stage | modules | plan ms ({(table or local).name}) | predicted ms "
          "(rannc spec) | predicted ms (local spec) | measured ms | measured / predicted (rannc "
          "spec) | measured / predicted (local) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in stages:
        print(f"| {s.dtype} | {s.stages} | {s.stage} | {s.modules} | {ms(s.planned)} | "
              f"{ms(s.predicted_table)} | {ms(s.predicted_local)} | {ms(s.measured)} | "
              f"{ratio(s.measured, s.predicted_table)} | "
              f"{ratio(s.measured, s.predicted_local)} |")
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(a.plot, stages, f"BERT L{a.layers} H{a.hidden}, batch {a.batch} x {a.seq}, "
                             f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")
        print(f"\nwrote {a.plot}")


if __name__ == "__main__":
    main()
