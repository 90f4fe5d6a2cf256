"""Pipeline schedules side by side (issue 5): fill-drain (gpipe), 1F1B and the shifted critical
path (scp), with and without recomputation.

    PYTHONPATH=. .venv/bin/python benchmarks/schedules.py            # everything below
    PYTHONPATH=. .venv/bin/python benchmarks/schedules.py --only simulated
    PYTHONPATH=. .venv/bin/python benchmarks/schedules.py --only measured --steps 6

* ``simulated``: BERT-Large (24 x 1024, batch 256 x 128) and BiT-ResNet-152x4 (batch 256 x
  224^2) planned with the estimate oracle for 8 and 32 V100-32GB (8 per node); per schedule, the
  planner's best plan under that schedule (forced) and its predicted iteration time, plus what
  ``schedule="auto"`` picks. Also one forced 4-stage x 2 (8 devices) and 8-stage x 4 (32
  devices) pipeline per model, where schedules matter most.
* ``measured``: a small BERT (4 x 256, vocabulary 2048, batch 32 x 128) and a small BiT-ResNet (loss computed
  inside the model, batch 32 x 64^2) on 2 CPU ranks (gloo, one thread each), 2 stages, 8
  microbatches, each schedule x recomputation off / half of every stage / all; per rank, the
  median iteration time over the steps after the first, the peak bytes autograd holds for
  backward (saved-tensor hooks; deterministic), the steady peak RSS increase (VmHWM reset after
  the first step, against the RSS before it; noisy: it counts what the C allocator keeps), and
  the simulator's iteration time from the run's own mean action times. The BERT runs without and with full
  recomputation and ResNet's 1F1B without write a trace and timeline to ``docs/``.

Ranks outnumbering cores would share them, which the simulator (one worker per stage) does not
model, so the measured part uses 2 ranks on this 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "models")]


# -- simulated ------------------------------------------------------------------------------------

def simulated(smoke: bool = False) -> list[str]:
    import logging

    import torch
    from bert_factory import bert
    from resnet import bit_resnet

    import rannc

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = ["| model | devices | forced layout | schedule | stages x replicas, microbatches | "
            "recompute per stage | predicted s/iter | bubble ratio | max stage memory GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in ("bert-large", "resnet152x4"):
        with torch.device("meta"):
            if name == "bert-large":
                model, kwargs = bert(2, 64, 32, seq=16, vocab=128) if smoke else bert(24, 1024, 256)
                args: tuple[Any, ...] = ()
            else:
                model = _WithLoss(bit_resnet(blocks=(1, 1), base_channels=8, num_classes=10)
                                  if smoke else bit_resnet(152, 4))
                n_img, side = (32, 16) if smoke else (256, 224)
                args = (torch.empty(n_img, 3, side, side), torch.zeros(n_img, dtype=torch.long))
                kwargs = {}
        from rannc.atomic.components import atomic_components
        from rannc.graph.capture import capture
        from rannc.planner import plan_graph

        cap = capture(model, args, kwargs)
        atomic = atomic_components(cap.graph)
        for n in (8,) if smoke else (8, 32):
            cluster = rannc.Cluster.homogeneous("V100-32GB", n=n, per_node=8)
            forced = [None, {"partition_num": 4 if n == 8 else 8,
                             "microbatches": 8 if n == 8 else 16}]
            for force in forced:
                for sched in ("auto", "gpipe", "1f1b", "scp"):
                    cfg = rannc.Config(schedule=sched, **(force or {}))
                    try:
                        p = plan_graph(cap.graph, atomic, cluster, cfg, batch_size=32 if smoke else 256)
                    except rannc.RaNNCError as e:
                        rows.append(f"| {name} | {n} | {force or 'auto'} | {sched} | {e} |||||")
                        continue
                    from rannc.schedule.predict import predict

                    tl = predict(p)
                    rc = ",".join(f"{st.recompute:.2g}" for st in p.stages)
                    mem = max(st.predicted["memory_bytes"] for st in p.stages) / 1e9
                    lay = f"{[st.replicas for st in p.stages]}, {p.microbatches}"
                    rows.append(f"| {name} | {n} | {_fmt_force(force)} | {sched} -> {p.schedule} | "
                                f"{lay} | {rc} | {p.predicted_iteration_time:.3f} | "
                                f"{tl.bubble_ratio:.2f} | {mem:.1f} |")
    return rows


def _fmt_force(force: dict[str, int] | None) -> str:
    return "auto" if not force else f"{force['partition_num']} stages, {force['microbatches']} mb"


class _WithLoss(__import__("torch").nn.Module):  # type: ignore[misc]
    """A classifier with its loss inside, so 1F1B can run the backward within forward()."""

    def __init__(self, net: Any) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Any, y: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(self.net(x), y)


# -- measured -------------------------------------------------------------------------------------

CONFIGS = [(s, rc) for rc in ("off", "half", "all") for s in ("gpipe", "1f1b", "scp")]


def measured(steps: int, smoke: bool = False) -> list[str]:
    rows = ["| model | schedule | recompute | rank | s/step (with optimizer) | s forward to "
            "gradients | simulated s (measured action times) | simulated / measured | peak MB saved "
            "for backward | steady peak RSS increase MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model in ("bert",) if smoke else ("bert", "resnet"):
        for sched, rc in [("gpipe", "off"), ("1f1b", "half")] if smoke else CONFIGS:
            keep = not smoke and ((model == "bert" and rc != "half")
                                  or (model, sched, rc) == ("resnet", "1f1b", "off"))
            trace = str(ROOT / "docs" / f"timeline_{model}_{sched}_recompute_{rc}") if keep else ""
            out = _launch(["--worker", "--model", model, "--schedule", sched, "--recompute", rc,
                           *(["--smoke"] if smoke else []),
                           "--steps", str(steps), "--trace", trace])
            for r in sorted(out, key=lambda x: x["rank"]):
                sim = r["simulated_s"]
                rows.append(f"| {model} | {sched} | {rc} | {r['rank']} | {r['median_s']:.3f} | "
                            f"{r['pipeline_s']:.3f} | {sim:.3f} | {sim / r['pipeline_s']:.2f} | "
                            f"{r['saved_mb']:.1f} | {r['peak_mb']:.0f} |")
            print("\n".join(rows[-len(out):]), flush=True)
    return rows


def _launch(args: list[str]) -> list[dict[str, Any]]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANNC_BACKEND="gloo", OMP_NUM_THREADS="1")
    cmd = [mpiexec, "-n", "2", sys.executable, __file__, *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return [json.loads(ln[len("RESULT "):]) for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]


def worker(a: argparse.Namespace) -> None:
    import torch

    import rannc
    from rannc import dist as rdist

    torch.set_num_threads(1)
    ctx = rdist.init_process_group(timeout_s=300)
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(0)
    batch = 8 if a.smoke else 32
    if a.model == "bert":
        from bert_factory import bert

        # vocabulary 2048: BERT's 30522-wide logits would make returning outputs (250 MB per
        # step over gloo) the bulk of a CPU step, which no schedule changes
        model, kw = bert(2, 64, batch, seq=16, vocab=128) if a.smoke else bert(4, 256, batch, vocab=2048)
        args: tuple[Any, ...] = ()
    else:
        from resnet import bit_resnet

        model = _WithLoss(bit_resnet(blocks=(2, 2, 2), base_channels=16, num_classes=10))
        args = (torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,)))
        kw = {}
    n = batch // world
    lo = rank * n

    def mine(x: Any) -> Any:
        return x[lo:lo + n] if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    largs = tuple(mine(x) for x in args)
    lkw = {k: mine(v) for k, v in kw.items()}
    frac = {"off": 0.0, "half": 0.5, "all": 1.0}[a.recompute]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=2, microbatches=8, schedule=a.schedule,
                                trace=True, extra={"recompute_fraction": frac})
    times: list[float] = []
    pipe: list[float] = []  # forward() to reduced gradients, the optimizer step excluded
    base = 0.0
    for step in range(a.steps):
        if step == 1:
            base = _rss_reset()
            _Saved.peak = _Saved.live
        t0 = time.perf_counter()
        # not around the first step: its capture traces with symbolic sizes
        hooks = torch.autograd.graph.saved_tensors_hooks(_Saved, _Saved.unpack)
        with hooks if step else contextlib.nullcontext():
            out = wrapped(*largs, **lkw)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        assert wrapped._last_rt is not None
        pipe.append(wrapped._last_rt.iteration_s)
    peak = _hwm() - base
    res: dict[str, Any] = {"rank": rank, "median_s": statistics.median(times[1:]),
                           "saved_mb": _Saved.peak / 2**20,
                           "pipeline_s": statistics.median(pipe[1:]),
                           "peak_mb": peak / 2**20}
    from rannc.schedule.predict import measured_costs
    from rannc.schedule.simulate import simulate

    rt = wrapped._last_rt
    assert rt is not None
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, (rank, rt.events))
    events = dict(every)
    tl = simulate(rt.schedule, measured_costs(rt.plan, events))
    res["simulated_s"] = tl.iteration_time
    if a.trace:
        wrapped.write_trace(a.trace, predicted_from="measured")
    results: list[Any] = [None] * world
    torch.distributed.all_gather_object(results, res)
    if rank == 0:  # one writer: ranks printing at once interleave their lines
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
    rdist.shutdown()


class _Saved:
    """Bytes autograd holds for backward (saved activations; weights too, the same under every
    schedule), counted from the saved-tensor hooks: a box per saved tensor, freed with the graph.
    Deterministic, unlike RSS, which also counts what the C allocator keeps."""

    live = 0
    peak = 0

    def __init__(self, t: Any) -> None:
        self.t = t
        self.n = t.numel() * t.element_size()
        _Saved.live += self.n
        _Saved.peak = max(_Saved.peak, _Saved.live)

    def __del__(self) -> None:
        _Saved.live -= self.n

    @staticmethod
    def unpack(box: Any) -> Any:
        return box.t


def _rss_reset() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _hwm() -> float:
    return _status("VmHWM")


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return float(ln.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("simulated", "measured"), default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", default="bert")
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--recompute", default="off")
    p.add_argument("--trace", default="")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    print(f"machine: {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    if a.only in (None, "simulated"):
        print("\n".join(simulated(a.smoke)), flush=True)
    if a.only in (None, "measured"):
        print("\n".join(measured(a.steps, a.smoke)), flush=True)


if __name__ == "__main__":
    main()
