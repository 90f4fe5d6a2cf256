"""Zero-bubble (ZB-H1 and ZB-V) and interleaved 1F1B against 1F1B (issue 19, item 4).

    PYTHONPATH=. .venv/bin/python benchmarks/new_schedules.py                # predicted
    PYTHONPATH=. .venv/bin/python benchmarks/new_schedules.py --only uniform
    PYTHONPATH=. .venv/bin/python benchmarks/new_schedules.py --pictures     # docs/ timelines
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/new_schedules.py --only measured \
        --ranks 4 --model standin --t-f 40 --t-b 40 --t-w 40   # layers that sleep (stand_in.py)

* ``uniform``: the simulator on 4 uniform stages (T_F = T_B = T_W = 1: a backward twice the
  forward, half of it weight gradients), 8, 16 and 32 microbatches; interleaved and ZB-V as 4
  ranks of 2 stages, each half as long.
* ``models``: BERT-Large (24 x 1024, batch 256 x 128) and a GPT (GPT-2 24 x 1024, batch 64 x 512)
  planned with the estimate oracle for 8 and 32 V100-32GB and 8 H100 (8 per node): 4 pipeline
  positions (ranks per pipeline copy) forced, 8 and 16 microbatches; per schedule the
  planner's best plan (1f1b and zero_bubble: 4 stages; interleaved_1f1b and zero_bubble_v: 8
  stages, 2 per rank),
  its predicted iteration time, its ratio to 1F1B's, and the largest predicted memory of one
  device (an interleaved rank holds two stages: their sum).
* ``measured``: the runtime on CPU ranks (gloo, one thread each), the BERT of
  benchmarks/runtime_peers.py (pre-LN layers, hidden 256, 8 layers, sequence 64, global batch
  32), ``--microbatches`` (8), no recomputation: 1F1B and the zero_bubble schedules
  (zero_bubble, zero_bubble_lag1, zero_bubble_lag0) on the same stages (one per rank: rannc's
  1F1B plan, loaded again with the schedule changed), and interleaved_1f1b and zero_bubble_v
  each on its own plan of two stages per rank. All six models live in the same
  ranks and take turns step by step (A B C D A B C D ...), so a drift in the machine's load
  hits them alike; per schedule the
  median step time (forward, backward, optimizer step; rank 0's clock between barriers) over
  the steps after the warm-up, the median of the per-round ratios to 1F1B, and per rank the most
  bytes autograd holds for backward at once (saved-tensor hooks: deterministic; in one more
  step per schedule after the timed ones, as the hooks cost time).
  ``--model standin``: the same with benchmarks/stand_in.py's layers, which sleep instead of
  computing (8 layers of T_F = T_B = T_W = 10 ms, ``--t-f`` etc.), so that 4 ranks on 2 cores
  behave like 4 devices (a waiting rank's time is lost, not given to another rank); the stages
  are cut evenly by layers (2 layers each; interleaved and ZB-V: 1), as the estimate oracle prices the
  sleeps at nothing. Nothing is saved for backward there (no memory column).
* ``--pictures``: the predicted timeline of each new schedule (4 stages, 8 microbatches,
  uniform) as docs/timeline_uniform_<schedule>.png and .json (Chrome trace).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "models")]

NEW = ("zero_bubble", "interleaved_1f1b", "zero_bubble_v")


def _uniform_schedule(name: str, M: int, lanes: int = 4) -> tuple[Any, Any]:
    """(schedule, costs) on `lanes` ranks of uniform work: T_F = 1, T_B = 2 (W = 1 of it); an
    interleaved schedule's 2 stages per rank each half of that."""
    from rannc.schedule import StageCosts, chain, get_spec, make_schedule

    v = get_spec(name).chunks
    S = lanes * v
    sched = make_schedule(name, M, chain(S), [False] * S)  # (its own placement: looped, or a V)
    return sched, StageCosts.uniform(S, 1.0 / v, 2.0 / v, wgrad=1.0 / v)


def uniform() -> list[str]:
    from rannc.schedule import in_flight, simulate

    rows = ["| stages (ranks) | microbatches | schedule | iteration (T_F units) | bubble ratio | "
            "vs 1F1B | most microbatches a rank holds (in 1F1B stages' worth) |",
            "|---|---|---|---|---|---|---|"]
    for M in (8, 16, 32):
        base = None
        for name in ("1f1b", *NEW):
            sched, costs = _uniform_schedule(name, M)
            tl = simulate(sched, costs)
            base = base or tl.iteration_time
            held = in_flight(sched)
            v = sched.stages // sched.lanes
            worth = max(sum(held[s][0] for s in sched.stages_on(d)) / v for d in range(sched.lanes))
            rows.append(f"| 4 | {M} | {name} | {tl.iteration_time:.2f} | {tl.bubble_ratio:.3f} | "
                        f"{base / tl.iteration_time:.3f}x | {worth:g} |")
    return rows


def _models(smoke: bool) -> list[tuple[str, Any, tuple[Any, ...], dict[str, Any], int]]:
    import torch
    from bert_factory import bert
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        if smoke:
            b, bkw = bert(4, 64, 32, seq=16, vocab=128)
            g = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, n_positions=32,
                                           vocab_size=128, use_cache=False))
            ids = torch.zeros(32, 32, dtype=torch.long)
            sizes = (32, 32)
        else:
            b, bkw = bert(24, 1024, 256)
            g = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=512,
                                           use_cache=False))
            ids = torch.zeros(64, 512, dtype=torch.long)
            sizes = (256, 64)
    return [("BERT-Large", b, (), bkw, sizes[0]),
            ("GPT-2 24x1024", g, (), {"input_ids": ids, "labels": ids, "use_cache": False}, sizes[1])]


def models(smoke: bool = False) -> list[str]:
    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import plan_graph
    from rannc.schedule import get_spec

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = ["| model | devices | microbatches | schedule | stages x replicas | predicted s/iter | "
            "vs 1F1B | weight share of backward | max device memory GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)  # rows print as they come: the full run takes minutes
    clusters = [("V100-32GB", 8)] if smoke else [("V100-32GB", 8), ("V100-32GB", 32), ("H100", 8)]
    for name, model, args, kwargs, batch in _models(smoke):
        cap = capture(model, args, kwargs)
        atomic = atomic_components(cap.graph)
        for dev, n in clusters:
            cluster = rannc.Cluster.homogeneous(dev, n=n, per_node=8)
            # 4 pipeline positions: the whole cluster in one pipeline copy on 8 devices is
            # 4 stages x 2 replicas; on 32, 4 copies of that (replicas forced per position)
            reps = [2, 2, 2, 2]
            for M in (8,) if smoke else (8, 16):
                base = None
                for sched in ("1f1b", *NEW):
                    stages = 4 * get_spec(sched).chunks
                    cfg = rannc.Config(schedule=sched, partition_num=stages, microbatches=M,
                                       replicas=reps)
                    try:
                        p = plan_graph(cap.graph, atomic, cluster, cfg, batch_size=batch)
                    except rannc.RaNNCError as e:
                        rows.append(f"| {name} | {n} x {dev} | {M} | {sched} | {e} |||||")
                        continue
                    t = p.predicted_iteration_time or 0.0
                    base = base or t
                    lanes: dict[tuple[int, ...], float] = {}
                    for st in p.stages:
                        lanes[st.ranks] = lanes.get(st.ranks, 0.0) + st.predicted["memory_bytes"]
                    share = sum(st.predicted.get("backward_weight_s", 0.0) for st in p.stages) / \
                        sum(st.predicted["backward_s"] for st in p.stages)
                    lay = f"{len(p.stages)} x {p.stages[0].replicas}"
                    rows.append(f"| {name} | {n} x {dev} | {M} | {sched} | {lay} | {t:.3f} | "
                                f"{base / t:.3f}x | {share:.2f} | {max(lanes.values()) / 1e9:.1f} |")
                    print(rows[-1], flush=True)
    return rows


def pictures() -> None:
    from rannc.schedule import chrome_trace, simulate, timeline_png

    what = {"zero_bubble": "B 1 ms + W 1 ms", "interleaved_1f1b": "2 stages per rank, half each",
            "zero_bubble_v": "2 stages per rank in a V, half each, B and W split"}
    for name in NEW:
        sched, costs = _uniform_schedule(name, 8)
        tl = simulate(sched, costs)
        # the simulator's units as milliseconds: T_F = 1 ms
        scaled = tl.__class__(tl.schedule, tuple(tuple(e.__class__(e.action, e.start / 1e3,
                                                                   e.end / 1e3) for e in evs)
                                                 for evs in tl.events),
                              tl.iteration_time / 1e3, tl.allreduce)
        base = ROOT / "docs" / f"timeline_uniform_{name}"
        chrome_trace(dict(enumerate(scaled.events)), f"{base}.json", label="rank")
        one, one_costs = _uniform_schedule("1f1b", 8)
        ref = simulate(one, one_costs).iteration_time
        timeline_png(f"{base}.png", predicted=scaled,
                     title=f"{name}: 4 ranks, 8 microbatches; per rank and microbatch forward 1 ms, "
                           f"backward 2 ms ({what[name]}); 1F1B: {ref:.0f} ms")
        print(f"wrote {base}.png and .json")


# the schedules run on 1F1B's very stages (its plan loaded again with the schedule changed)
SAME_STAGES = ("zero_bubble", "zero_bubble_lag1", "zero_bubble_lag0")
MEASURED = ("1f1b", *SAME_STAGES, "interleaved_1f1b", "zero_bubble_v")


def measured(a: argparse.Namespace) -> None:
    import json
    import subprocess

    from benchmarks.pipeline_memory import cores_note
    from benchmarks.pipeline_memory import mpiexec as find_mpiexec

    mpiexec = find_mpiexec()
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANNC_BACKEND="gloo", OMP_NUM_THREADS="1")
    if a.smoke and a.model == "standin":  # the smoke checks the script runs: 1 ms sleeps
        a.t_f = a.t_b = a.t_w = 1.0
    waits = f", per layer T_F {a.t_f:g} ms, T_B {a.t_b:g} ms, T_W {a.t_w:g} ms"
    print(f"model {a.model}, {a.microbatches} microbatches{waits if a.model == 'standin' else ''}")
    print("| ranks | schedule | stages on ranks | median s/step | vs 1F1B (median of per-round "
          "ratios) | autograd's peak MB per rank |\n|---|---|---|---|---|---|", flush=True)
    for n in a.ranks:
        cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--worker", "--steps",
               str(2 if a.smoke else a.steps), *(["--smoke"] if a.smoke else []),
               "--model", a.model, "--microbatches", str(a.microbatches), "--layers", str(a.layers),
               f"--t-f={a.t_f}", f"--t-b={a.t_b}", f"--t-w={a.t_w}"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        out = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        for name in MEASURED:
            r = out[name]
            mem = " / ".join(f"{x:.0f}" for x in r["saved_mb"])
            print(f"| {n}{cores_note(n)} | {name} | {r['layout']} | "
                  f"{r['median_s']:.3f} | {r['ratio']:.3f}x | "
                  f"{'- (nothing saved)' if a.model == 'standin' else mem} |", flush=True)


def worker(a: argparse.Namespace) -> None:
    import dataclasses
    import json
    import statistics
    import tempfile

    import torch
    import torch.distributed as dist

    import rannc
    from benchmarks.runtime_peers import aligned_plan, batches, build
    from benchmarks.schedules import _Saved
    from rannc import dist as rdist
    from rannc.schedule import get_spec

    torch.set_num_threads(1)
    rdist.init_process_group(timeout_s=600)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    stand = a.model == "standin"
    ns = argparse.Namespace(vocab=128 if a.smoke else 4096, hidden=32 if a.smoke else 256,
                            layers=2 if a.smoke else a.layers, heads=2 if a.smoke else 4,
                            seq=16 if a.smoke else 64, batch=8 if a.smoke else 32,
                            microbatches=a.microbatches, t_f=a.t_f, t_b=a.t_b, t_w=a.t_w)
    if stand and a.smoke:  # two layers a stage (interleaved: one)
        ns.layers = 2 * world
    data = batches(a.model, ns, 1)
    (x, y), = data
    lo, hi = rank * ns.batch // world, (rank + 1) * ns.batch // world
    tmp = Path(tempfile.gettempdir()) / f"rannc_new_schedules_{os.getppid()}"
    if stand:  # stages cut evenly by layers (the estimate oracle prices sleeps at nothing)
        if rank == 0:
            tmp.mkdir(exist_ok=True)
            for name, stages in (("1f1b", world), ("interleaved_1f1b", 2 * world),
                                 ("zero_bubble_v", 2 * world)):
                aligned_plan("standin", ns, world, name, tmp / f"plan_{name}.json", stages=stages)
        dist.barrier()
    models: dict[str, Any] = {}
    for name in MEASURED:
        wrapper, _, _ = build(a.model, ns)  # the same initial weights for each (seed 0)
        opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
        stages = get_spec(name).chunks * world
        opts: dict[str, Any] = dict(partition_num=stages, microbatches=a.microbatches,
                                    checkpointing="off", schedule=name, profiler="estimate")
        if stand and name not in SAME_STAGES:
            opts.update(load_deployment=True, deployment_file=str(tmp / f"plan_{name}.json"))
        elif name in SAME_STAGES:  # 1F1B's very stages
            plan_file = tmp / "plan_1f1b.json"
            if rank == 0:
                zb = dataclasses.replace(rannc.Plan.load(plan_file), schedule=name)
                zb.save(tmp / f"plan_same_{name}.json")
            dist.barrier()
            opts.update(load_deployment=True, deployment_file=str(tmp / f"plan_same_{name}.json"))
        elif name == "1f1b":
            tmp.mkdir(exist_ok=True)
            opts.update(save_deployment=True, deployment_file=str(tmp / "plan_1f1b.json"))
        model = rannc.RaNNCModule(wrapper, opt, **opts)
        model(x[lo:hi], y[lo:hi]).backward()  # the first call plans (or loads) and deploys
        opt.step()
        opt.zero_grad()
        models[name] = (model, opt)
    times: dict[str, list[float]] = {name: [] for name in MEASURED}
    peaks: dict[str, float] = {}

    def step(name: str) -> None:
        model, opt = models[name]
        loss = model(x[lo:hi], y[lo:hi])
        loss.backward()
        opt.step()
        opt.zero_grad()

    for rnd in range(a.steps + 1):
        k = rnd % len(MEASURED)
        order = MEASURED[k:] + MEASURED[:k]  # who goes first rotates
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            dist.barrier()
            if rnd >= 1:  # warm-up
                times[name].append(time.perf_counter() - t0)
    # memory: one more step each, apart from the timed ones (the hooks cost time, and under
    # them zero_bubble's W walks the input path again: rannc.pipeline.split_backward)
    for name in MEASURED:
        _Saved.live = _Saved.peak = 0
        with torch.autograd.graph.saved_tensors_hooks(_Saved, _Saved.unpack):
            step(name)
        peaks[name] = _Saved.peak / 2**20
    every: list[Any] = [None] * world
    dist.all_gather_object(every, peaks)
    if rank == 0:
        out = {}
        for name in MEASURED:
            plan = models[name][0].plan
            ratio = statistics.median(b / t for b, t in zip(times["1f1b"], times[name], strict=True))
            out[name] = {"median_s": statistics.median(times[name]), "ratio": ratio,
                         "layout": f"{len(plan.stages)} on {world}",
                         "saved_mb": [p[name] for p in every]}
        print("RESULT " + json.dumps(out), flush=True)
    rdist.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("uniform", "models", "measured"), default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", choices=("bert", "standin"), default="bert",
                   help="measured: the BERT of runtime_peers.py, or layers that sleep")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--t-f", type=float, default=10.0, help="standin: ms one layer sleeps in forward")
    p.add_argument("--t-b", type=float, default=10.0, help="standin: ms in its input gradient")
    p.add_argument("--t-w", type=float, default=10.0, help="standin: ms in its weight gradient")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pictures", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    print(f"machine: {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    if a.pictures:
        pictures()
        return
    if a.only == "measured":
        measured(a)
        return
    if a.only in (None, "uniform"):
        print("\n".join(uniform()), flush=True)
    if a.only in (None, "models"):
        models(a.smoke)


if __name__ == "__main__":
    main()
