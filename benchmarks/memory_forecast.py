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

`--loop drop` (the default) is Trainer's loop: the batch outputs go before backward and
`zero_grad()` frees the gradients; `--loop accumulate` is that loop over two calls a step, the
first under `no_sync()`; `--loop hold` keeps the outputs through the step and zeroes
the gradients in place (Hugging Face's `no_trainer` examples keep `outputs` alive); the
forecast reserves for its outputs, not for its zeroed gradients beside the ones a schedule that
runs backward inside forward() computes (BENCHMARKS.md, "Gradients kept twice").

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
import math
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


CATEGORIES = ("parameter", "optimizer_state", "gradient", "input", "activation", "temporary",
              "autograd_detail", "unknown")


def tensor_peak(prof: Any) -> tuple[float, dict[str, float], str]:
    """Peak bytes of live CPU tensors during the profiled step (torch's memory timeline: every
    allocation and free the profiler saw, by category, summed), those bytes by the profiler's
    category, and the rannc action (`rannc B0.3`) running at the peak."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of a CUDA-only API
        prof.export_memory_timeline(str(Path(d, "t.json")), device="cpu")
        times, sizes = json.loads(Path(d, "t.json").read_text())
    if not sizes:
        return 0.0, {}, ""
    i = max(range(len(sizes)), key=lambda j: sum(sizes[j]))
    names = ["-"] + [c.name.lower() if c is not None else "unknown" for c in _CATEGORY_TO_INDEX]
    by_cat = {n: float(x) for n, x in zip(names, sizes[i], strict=True) if x}
    start = prof.profiler.kineto_results.trace_start_ns() / 1e3
    t = times[i]
    acts = [e for e in prof.events() if e.name.startswith("rannc ")
            and start + e.time_range.start <= t <= start + e.time_range.end]
    at = min(acts, key=lambda e: e.time_range.elapsed_us()).name if acts else ""
    return float(sum(sizes[i])), by_cat, at


def forecast_terms(plan: Any, st: Any, opt_factor: float, fused: bool = False) -> dict[str, float]:
    """The memory model's terms for stage `st` of `plan` (bytes), from the estimate on a CPU, or
    on a device running fused attention and dropout kernels (`fused`: a GPU)."""
    from rannc.profile.estimate import GraphCosts
    from rannc.schedule import get_spec
    from rannc.schedule.spec import past_b_counts, pending_counts
    from rannc.stage_dp.memory import local_rows, rank_overhead, returned_memory, split_backward_bytes
    from rannc.stage_dp.tables import BlockIO

    graph, atomic = plan.source
    comps = set(st.components)
    costs = GraphCosts.of(graph, atomic, fused=fused)
    # blocks: 0 the components before the stage (maybe none), 1 the stage, 2 those after
    io = BlockIO.of(graph, atomic, [0 if c < min(comps) else 1 if c in comps else 2
                                    for c in range(len(atomic.components))])
    j = 1
    b = st.predicted["microbatch_rows"]
    mask = [c in comps for c in costs.pair_comp]
    kept = float(((costs.kept[:, 0] + costs.kept[:, 1] * b)[costs.pair_task])[mask].sum())
    work = float(((costs.work[:, 0] + costs.work[:, 1] * b)[costs.pair_task])[mask].max())
    # a split backward: what B changes of a microbatch's bytes (the gradients it keeps for W
    # less what only it reads), counted as the memory model does (`memory_terms`; nothing on
    # the first stage: its B has nothing to do)
    pend = pending_counts(plan.schedule, len(plan.stages), plan.microbatches)[st.index]
    past = past_b_counts(plan.schedule, len(plan.stages), plan.microbatches)[st.index]

    def stage_sum(x: Any) -> float:
        return float(((x[:, 0] + x[:, 1] * b)[costs.pair_task])[mask].sum()) if x is not None else 0.0

    # (under selective recomputation the saved tensors carry hooks of their own: none released)
    grads = stage_sum(costs.stash) if st.index > 0 else 0.0
    released = stage_sum(costs.bonly) if st.index > 0 and not st.selective else 0.0
    n = st.predicted["in_flight"]
    saved = get_spec(plan.schedule).held(len(plan.stages), plan.microbatches, True).saved_inputs
    inb = float(io.inputs[0][j, j] + io.inputs[1][j, j] * b)
    outb = float(io.outputs[0][j, j] + io.outputs[1][j, j] * b)
    ret = returned_memory(*io.returned_bytes(int(b), local_rows(plan.batch_size, 1, plan.world_size)),
                          plan.microbatches, int(n))
    return dict(params=float(io.params[j, j]), grads=float(io.grad_params[j, j]),
                optimizer=opt_factor * float(io.grad_params[j, j]), kept=n * kept,
                inputs_outputs=n * (inb + outb), saved_inputs=saved * inb, work=work,
                stash=float(split_backward_bytes(grads, released, pend, past)),
                returned_held=float(ret.held[j, j]), at_return=float(ret.at_return[j, j]),
                overhead=0.0 if fused else rank_overhead(["local-cpu"], len(graph.tasks)))


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

    # (on the CPU under --autocast: autocast does not act on meta tensors, whose graph would be
    # float32; freed before the baseline all the same)
    with torch.device("cpu" if a.autocast else "meta"):
        planned = build(a.model, a)
    factor = optimizer_state_factor(torch.optim.AdamW(planned.parameters(), lr=1e-4))
    # `--autocast`: every forward (capture and planning included) under CPU bfloat16 autocast
    casting = torch.autocast("cpu", torch.bfloat16, enabled=a.autocast)
    with casting:
        one = rannc.plan(planned, kwargs=batch, config=rannc.Config(
            partition_num=1, microbatches=1, opt_param_factor=factor, progress=False))
    del planned
    gc.collect()
    trim()
    base_kb = pm.status_kb("VmRSS")
    net = build(a.model, a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model = rannc.RaNNCModule(net, opt, partition_num=world // a.replicas, microbatches=a.microbatches,
                              replicas=[a.replicas] * (world // a.replicas) if a.replicas > 1 else None,
                              checkpointing=a.checkpointing, host_malloc=a.host_malloc,
                              schedule=a.schedule)
    steady_kb = 0
    tensor_peak_b = 0.0
    peak_by: dict[str, float] = {}
    peak_at = ""
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
        if a.loop == "accumulate":  # Trainer's loop over 2 micro-steps, the first under no_sync()
            with model.no_sync():
                with casting:
                    loss = model(**batch).loss
                (loss / 2).backward()
        with casting:
            out_ = model(**batch)
        loss = out_.loss
        if a.loop != "hold":  # the batch outputs (logits) go before backward, as Trainer's loop
            del out_
        losses.append(float(loss))
        (loss / 2 if a.loop == "accumulate" else loss).backward()
        opt.step()
        # "hold": the gradients stay allocated (zeroed in place) and the outputs live through
        # backward and the step, as in Hugging Face's no_trainer examples
        opt.zero_grad(set_to_none=a.loop != "hold")
        out_ = None
        if last:
            prof.__exit__(None, None, None)
            try:
                tensor_peak_b, peak_by, peak_at = tensor_peak(prof)
            except AssertionError as e:  # torch's memory profiler refuses some traces
                # ("duplicate outputs", seen under autocast): the row reports no tensor peak
                tensor_peak_b, peak_at = math.nan, f"torch.profiler failed: {e}"[:80]
            del prof
        if step == 0:
            gc.collect()
            pm.reset_peak()
    plan = model.plan if world > 1 else one
    st = plan.stage_of_rank(rank) if plan is not None else None
    out = dict(model=a.model, world=world, rank=rank, stage=st.index if st else 0,
               layout=f"{len(plan.stages) if plan is not None else 1} x {a.replicas}",
               forecast_b=st.predicted.get("memory_bytes") if st else None,
               in_flight=st.predicted.get("in_flight") if st else None,
               recompute=st.recompute if st else None,
               schedule=plan.schedule if plan is not None else None,
               measured_kb=steady_kb - base_kb, live_b=live_b, tensor_peak_b=tensor_peak_b,
               rest_kb=rest_kb - base_kb, losses=losses, peak_by=peak_by, peak_at=peak_at,
               terms=forecast_terms(plan, st, factor) if st is not None else {},
               params=sum(p.numel() for p in net.parameters()))
    Path(a.out, f"{a.model}.{world}.{rank}.json").write_text(json.dumps(out))
    if world > 1:
        rdist.shutdown()


def driver(a: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp(prefix="rannc_memory_forecast_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = [f"--{k}={v}" for k, v in (("layers", a.layers), ("hidden", a.hidden), ("heads", a.heads),
                                        ("vocab", a.vocab), ("batch", a.batch), ("seq", a.seq),
                                        ("steps", a.steps), ("microbatches", a.microbatches),
                                        ("out", out), ("replicas", a.replicas),
                                        ("checkpointing", a.checkpointing),
                                        ("host-malloc", a.host_malloc), ("schedule", a.schedule),
                                        ("loop", a.loop))]
    common += ["--autocast"] if a.autocast else []
    try:
        for model in a.models:
            for s in a.stages:
                cmd = [*me, "--worker", "--model", model, *common]
                if s * a.replicas > 1:
                    cmd = [pm.mpiexec(), "-n", str(s * a.replicas), *cmd]
                pm.launch(cmd, a.timeout)
        rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nL{a.layers} H{a.hidden} A{a.heads} vocab {a.vocab}, global batch {a.batch} x {a.seq}, "
          f"{a.microbatches} microbatches, AdamW, {a.steps} steps, checkpointing {a.checkpointing}, "
          f"host_malloc {a.host_malloc}, schedule {a.schedule}, loop {a.loop}"
          f"{', bfloat16 autocast' if a.autocast else ''}\n")
    head = ["model", "stages x replicas", "rank", "schedule, in flight, recompute", "forecast MiB",
            "measured peak MiB", "measured / forecast", "tensor peak MiB", "tensors / forecast",
            "live tensors at rest MiB", "RSS at rest (trimmed) MiB", "loss, last step"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    ratios = []
    for r in sorted(rows, key=lambda r: (r["model"], r["world"], r["rank"])):
        f = r["forecast_b"] or float("nan")
        ratio = r["measured_kb"] * 1024 / f
        ratios.append(ratio)
        print(f"| {r['model']} | {r['layout']} | {r['rank']} | {r['schedule']}, {r['in_flight']:.0f}, "
              f"{r['recompute']:.2f} | {f / MB:.1f} | {r['measured_kb'] / 1024:.1f} | {ratio:.2f} | "
              f"{r['tensor_peak_b'] / MB:.1f} | {r['tensor_peak_b'] / f:.2f} | "
              f"{r['live_b'] / MB:.1f} | {r['rest_kb'] / 1024:.1f} | {r['losses'][-1]:.5f} |")
    within = sum(0.87 <= x <= 1.15 for x in ratios)
    print(f"\nmeasured / forecast: {min(ratios):.2f} to {max(ratios):.2f}; "
          f"within 15 %: {within} of {len(ratios)}")
    if a.breakdown:
        print("\nThe forecast's terms and the tensor peak by the profiler's category (MiB), and the "
              "action running at the peak:\n")
        terms = ["params", "grads", "optimizer", "inputs_outputs", "saved_inputs", "kept", "stash", "work",
                 "returned_held", "at_return", "overhead"]
        head = ["model", "stages x replicas", "rank", *terms, "|", *CATEGORIES, "at"]
        print("| " + " | ".join(head) + " |")
        print("|---" * len(head) + "|")
        for r in sorted(rows, key=lambda r: (r["model"], r["world"], r["rank"])):
            t, c = r["terms"], r["peak_by"]
            print(f"| {r['model']} | {r['layout']} | {r['rank']} | "
                  + " | ".join(f"{t.get(k, 0) / MB:.1f}" for k in terms) + " | | "
                  + " | ".join(f"{c.get(k, 0) / MB:.1f}" for k in CATEGORIES) + f" | {r['peak_at']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--replicas", type=int, default=1, help="replicas of every stage (ranks: stages x this)")
    p.add_argument("--checkpointing", default="auto", choices=("auto", "on", "off", "selective"))
    p.add_argument("--schedule", default="auto", help="Config.schedule of the pipelined runs")
    p.add_argument("--host-malloc", default="auto", choices=("auto", "reuse", "release", "keep"),
                   help="Config.host_malloc of every rank")
    p.add_argument("--autocast", action="store_true",
                   help="train (and capture and plan) under CPU bfloat16 autocast")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--loop", default="drop", choices=("drop", "hold", "accumulate"),
                   help="drop: the outputs go before backward and zero_grad sets gradients to None "
                        "(Trainer's loop); hold: the outputs live through the step and the "
                        "gradients are zeroed in place; accumulate: drop's loop over two calls "
                        "a step, the first under no_sync() (so the plan, made by the first, "
                        "counts an accumulation: grad_accumulation 'auto')")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="2 layers H64, 1 and 2 stages, 3 steps")
    p.add_argument("--breakdown", action="store_true",
                   help="also the forecast's terms against the tensor peak by category")
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
