"""The planner's memory forecast against the measured per-rank peak, BERT and GPT-2, 1, 2 and 4 stages.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_forecast.py                 # the table in BENCHMARKS.md
    PYTHONPATH=. .venv/bin/python benchmarks/memory_forecast.py --smoke         # seconds

Each cell trains a Hugging Face model built from a small config with random weights (no
download) under `rannc.RaNNCModule` on S ranks with `partition_num=S` (one replica per stage),
4 microbatches, AdamW, for `--steps` steps, each rank in a fresh process (`mpiexec -n S`; S = 1
runs one plain process). Per rank it reports:

* forecast: the deployed plan's `predicted["memory_bytes"]` for the rank's stage (what the
  planner checks against the device memory);
* measured: the peak resident memory from step 2 to the last but one (`VmHWM`, reset after
  step 1) minus `VmRSS` before the model was built (after the imports, the batch and the process
  group);
* tensor peak: the most bytes of live CPU tensors during the last step, from torch.profiler's memory
  timeline (every allocation and free it saw): what a GPU's `max_memory_allocated` would
  report, without the C allocator's retained heap;
* at rest: live tensor bytes before the last step (distinct CPU storages: the held parameters,
  their gradients freed by `zero_grad`, the AdamW state), and resident memory after a final
  `malloc_trim` (what the process keeps between steps once the C allocator returns free pages);
* measured / forecast: the goal is within 15 % (0.87 to 1.15).

On a GPU the right measure is `torch.cuda.max_memory_allocated`; this script measures the CPU
process, whose peak also holds what the forecast does not count (the captured and stage graphs,
the C allocator's retained heap). The helpers (`VmHWM` reset, storage accounting, launcher)
come from `benchmarks/pipeline_memory.py`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_memory as pm  # noqa: E402  (its launcher and VmHWM helpers)

MB = 2**20
MODELS = ("bert", "gpt2")


def local_batch(a: argparse.Namespace) -> dict[str, Any]:
    """This rank's rows of the global batch (cut evenly among the ranks)."""
    import torch

    from rannc import dist as rdist

    ids = torch.randint(5, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    rank, world = rdist.get_rank(), rdist.get_world_size()
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world
    return dict(input_ids=ids[lo:hi].contiguous(), labels=ids[lo:hi].clone())


def build(model: str, a: argparse.Namespace) -> Any:
    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    net: Any
    if model == "bert":
        net = BertForMaskedLM(BertConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                         num_attention_heads=a.heads, intermediate_size=4 * a.hidden,
                                         max_position_embeddings=max(512, a.seq)))
    else:
        net = GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_embd=a.hidden, n_layer=a.layers,
                                         n_head=a.heads, n_positions=max(512, a.seq), use_cache=False))
    return net


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def tensor_peak(prof: Any) -> float:
    """Peak bytes of live CPU tensors during the profiled step (torch's memory timeline: every
    allocation and free the profiler saw, by category, summed)."""
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of a CUDA-only API
        prof.export_memory_timeline(str(Path(d, "t.json")), device="cpu")
        _times, sizes = json.loads(Path(d, "t.json").read_text())
    return float(max(sum(x) for x in sizes)) if sizes else 0.0


def worker(a: argparse.Namespace) -> None:
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    import rannc
    from rannc import dist as rdist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    if world > 1:
        rdist.init_process_group(timeout_s=600)
    batch = local_batch(a)
    # The pure planner's plan for one stage and one microbatch, on a meta-device copy: the
    # forecast where one process runs the captured graph unplanned (model.plan is None there).
    # Made on every rank before the baseline, so that the modules capture and planning import
    # (torch.export's among them: tens of MiB) are not counted as the run's memory.
    from rannc.module import optimizer_state_factor

    with torch.device("meta"):
        meta = build(a.model, a)
    factor = optimizer_state_factor(torch.optim.AdamW(meta.parameters(), lr=1e-4))
    one = rannc.plan(meta, kwargs=batch, config=rannc.Config(
        partition_num=1, microbatches=1, opt_param_factor=factor, progress=False))
    del meta
    gc.collect()
    trim()
    base_kb = pm.status_kb("VmRSS")
    net = build(a.model, a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model = rannc.RaNNCModule(net, opt, partition_num=world, microbatches=a.microbatches)
    steady_kb = 0
    tensor_peak_b = 0.0
    live_b = rest_kb = 0
    losses = []
    for step in range(a.steps):
        last = step == a.steps - 1 and a.steps > 2
        if last:  # RSS measured up to here: the profiler's own buffers stay resident after it
            steady_kb = pm.status_kb("VmHWM")
            live_b = pm.storage_bytes(pm.live_tensors())
            gc.collect()
            trim()
            rest_kb = pm.status_kb("VmRSS")
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                           with_stack=True)
            prof.__enter__()
        loss = model(**batch).loss
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if last:
            prof.__exit__(None, None, None)
            tensor_peak_b = tensor_peak(prof)
            del prof
        if step == 0:
            gc.collect()
            pm.reset_peak()
    plan = model.plan if world > 1 else one
    st = plan.stage_of_rank(rank) if plan is not None else None
    out = dict(model=a.model, world=world, rank=rank, stage=st.index if st else 0,
               forecast_b=st.predicted.get("memory_bytes") if st else None,
               in_flight=st.predicted.get("in_flight") if st else None,
               recompute=st.recompute if st else None,
               schedule=plan.schedule if plan is not None else None,
               measured_kb=steady_kb - base_kb, live_b=live_b, tensor_peak_b=tensor_peak_b,
               rest_kb=rest_kb - base_kb, losses=losses,
               params=sum(p.numel() for p in net.parameters()))
    Path(a.out, f"{a.model}.{world}.{rank}.json").write_text(json.dumps(out))
    if world > 1:
        rdist.shutdown()


def driver(a: argparse.Namespace) -> None:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    out = Path(tempfile.mkdtemp(prefix="rannc_memory_forecast_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = [f"--{k}={v}" for k, v in (("layers", a.layers), ("hidden", a.hidden), ("heads", a.heads),
                                        ("vocab", a.vocab), ("batch", a.batch), ("seq", a.seq),
                                        ("steps", a.steps), ("microbatches", a.microbatches),
                                        ("out", out))]
    try:
        for model in a.models:
            for s in a.stages:
                cmd = [*me, "--worker", "--model", model, *common]
                if s > 1:
                    if mpiexec is None:
                        sys.exit("no mpiexec next to the interpreter or on PATH (pip install mpi4py mpich)")
                    cmd = [mpiexec, "-n", str(s), *cmd]
                pm.launch(cmd, a.timeout)
        rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nL{a.layers} H{a.hidden} A{a.heads} vocab {a.vocab}, global batch {a.batch} x {a.seq}, "
          f"{a.microbatches} microbatches, AdamW, {a.steps} steps\n")
    head = ["model", "stages", "rank", "schedule, in flight, recompute", "forecast MiB",
            "measured peak MiB", "measured / forecast", "tensor peak MiB", "tensors / forecast",
            "live tensors at rest MiB", "RSS at rest (trimmed) MiB", "loss, last step"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    ratios = []
    for r in sorted(rows, key=lambda r: (r["model"], r["world"], r["rank"])):
        f = r["forecast_b"] or float("nan")
        ratio = r["measured_kb"] * 1024 / f
        ratios.append(ratio)
        print(f"| {r['model']} | {r['world']} | {r['rank']} | {r['schedule']}, {r['in_flight']:.0f}, "
              f"{r['recompute']:.2f} | {f / MB:.1f} | {r['measured_kb'] / 1024:.1f} | {ratio:.2f} | "
              f"{r['tensor_peak_b'] / MB:.1f} | {r['tensor_peak_b'] / f:.2f} | "
              f"{r['live_b'] / MB:.1f} | {r['rest_kb'] / 1024:.1f} | {r['losses'][-1]:.5f} |")
    within = sum(0.87 <= x <= 1.15 for x in ratios)
    print(f"\nmeasured / forecast: {min(ratios):.2f} to {max(ratios):.2f}; "
          f"within 15 %: {within} of {len(ratios)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="2 layers H64, 1 and 2 stages, 3 steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke and not a.worker:
        a.layers, a.hidden, a.heads, a.vocab, a.batch, a.seq, a.steps = 2, 64, 2, 256, 8, 16, 3
        a.stages = [1, 2]
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
