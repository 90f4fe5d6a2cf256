"""What each new input signature costs beside its capture: process groups and kept bucket buffers.

    python benchmarks/signatures.py --launch 2          # transformers' BERT, 8 sequence lengths
    python benchmarks/signatures.py --smoke             # tiny, seconds

Dynamic padding (Hugging Face's default collator pads each batch to its longest sequence) calls
the model with a new sequence length at most steps; rannc captures each new signature and builds
a runtime for it (up to `max_captures` are kept). Every rank trains a transformers
`BertForSequenceClassification` (random weights, one stage on every rank) for one step per
sequence length and makes an eval call after each, then prints, per step, the process groups
this rank is in (torch never frees one: a gloo group holds a connection to each member and
threads, an NCCL one a communicator and its buffers), the kept gradient-bucket buffers of
all the model's runtimes (distinct storages and their MiB) beside the gradients' MiB, the
generated sources torch.fx keeps process-wide (one per graph module compiled: entries, MB), the
torch ShapeEnvs alive (one per capture torch.export made: its fake mode, fake tensors, caches)
and the process's resident MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kept_buffers(wrapped: Any) -> dict[int, int]:
    """Distinct kept bucket-buffer storages of the model's runtimes -> bytes (the reducers kept
    one each before they shared the model's: `_spares`; `buffers._spares` since)."""
    out: dict[int, int] = {}
    for rt in wrapped._runtimes.values():
        g = rt.grads
        spares = g.buffers._spares if hasattr(g, "buffers") else g._spares
        for t in spares.values():
            out[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return out


def worker(a: argparse.Namespace) -> None:
    import gc

    import pipeline_memory as pm
    import torch
    from torch.distributed import distributed_c10d as c10d
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.graph_module import _loader
    from transformers import BertConfig, BertForSequenceClassification

    import rannc
    from rannc import dist as rdist

    rdist.init_process_group(timeout_s=600)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                     num_attention_heads=a.heads, intermediate_size=4 * a.hidden,
                     max_position_embeddings=max(a.seqs), num_labels=4)
    model = BertForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=1)  # (max_captures: 8, the default)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for step, seq in enumerate(a.seqs):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, a.vocab, (a.batch, seq), generator=g)
        labels = torch.randint(0, 4, (a.batch,), generator=g)
        out = wrapped(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        wrapped.eval()
        with torch.no_grad():
            wrapped(input_ids=ids)
        wrapped.train()
        kept = kept_buffers(wrapped)
        gc.collect()
        gc.collect()  # (what the first pass makes collectable)
        rows.append({"step": step, "seq": seq, "groups": len(c10d._world.pg_map),
                     "buffers": len(kept), "buffer_mib": sum(kept.values()) / 2**20,
                     "grad_mib": grads / 2**20, "runtimes": len(wrapped._runtimes),
                     "fx_sources": len(_loader.eval_cache),
                     "fx_mb": sum(len(s) for s in _loader.eval_cache.values()) / 1e6,
                     "shape_envs": sum(isinstance(o, ShapeEnv) for o in gc.get_objects()),
                     "rss_mib": pm.status_kb("VmRSS") / 1024})
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": world, "rows": rows}), flush=True)
    rdist.shutdown()


def launch(a: argparse.Namespace) -> None:
    import pipeline_memory as pm

    mpiexec = pm.mpiexec()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    args = [x for x in sys.argv[1:] if x != "--smoke"]
    if a.smoke:
        args += ["--vocab", str(a.vocab), "--hidden", str(a.hidden), "--layers", str(a.layers),
                 "--heads", str(a.heads), "--seqs", *map(str, a.seqs)]
    cmd = [mpiexec, "-n", str(a.launch), sys.executable, __file__, "--worker", *args]
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode or line is None:
        sys.exit(f"failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    got = json.loads(line[len("RESULT "):])
    print(f"\n{got['ranks']} ranks, rank 0, after each training step and eval call:\n")
    print("| step | sequence length | runtimes | process groups | kept bucket buffers | their MiB "
          "| gradients MiB | torch.fx sources | their MB | ShapeEnvs | resident MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in got["rows"]:
        print(f"| {r['step']} | {r['seq']} | {r['runtimes']} | {r['groups']} | {r['buffers']} "
              f"| {r['buffer_mib']:.2f} | {r['grad_mib']:.2f} | {r['fx_sources']} "
              f"| {r['fx_mb']:.2f} | {r['shape_envs']} | {r['rss_mib']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", type=int, default=2, help="ranks")
    p.add_argument("--seqs", type=int, nargs="+",
                   default=[16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 16])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="rows per rank")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--smoke", action="store_true", help="a tiny BERT, 3 sequence lengths")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.vocab, a.hidden, a.layers, a.heads, a.seqs = 128, 32, 1, 2, [8, 12, 16]
    if a.worker:
        worker(a)
    else:
        launch(a)


if __name__ == "__main__":
    main()
