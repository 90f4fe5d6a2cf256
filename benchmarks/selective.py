"""Selective recomputation measured on this machine: what autograd keeps for backward and what a
forward + backward costs, with and without the recipes (`rannc.pipeline.selective`), on Hugging
Face decoder models built from configs (random weights), one process, CPU (or `--device cuda`:
fused attention, times between synchronisations, and the peak each variant's forward and
backward allocate). Also checks that the gradients are bit-identical, and prints the memory
model's figures for the same graph.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/selective.py
    PYTHONPATH=. python benchmarks/selective.py --device cuda --dtype bf16 --layers 8 \
        --hidden 2048 --seq 2048 --batch 4

The two variants alternate (ABBA) so the machine's load hits both alike; times are medians.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rannc.graph.capture import capture, flatten_inputs  # noqa: E402
from rannc.pipeline.selective import Recorder, instrument  # noqa: E402
from rannc.profile.saved import recomputable, saved  # noqa: E402

MODELS = ("llama", "mistral", "gpt2")


class LossOnly(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def build(kind: str, layers: int, hidden: int, seq: int) -> torch.nn.Module:
    import transformers as tr

    heads = max(1, hidden // 64)
    if kind == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads,
                                                n_positions=seq, vocab_size=4096, use_cache=False,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    common = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  vocab_size=4096, max_position_embeddings=seq, use_cache=False)
    cfg = tr.MistralConfig(**common) if kind == "mistral" else tr.LlamaConfig(**common)
    return (tr.MistralForCausalLM if kind == "mistral" else tr.LlamaForCausalLM)(cfg)


def one(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = LossOnly(build(kind, a.layers, a.hidden, a.seq)).to(dev, dtype).train()
    ids = torch.randint(0, 4096, (a.batch, a.seq), device=dev)
    kw = {"input_ids": ids, "labels": ids}
    cap = capture(model, (), kw)
    leaves, _ = flatten_inputs((), kw)
    env = cap.bind(model, leaves)
    ph = [env.get(n.name) for n in cap.gm.graph.nodes if n.op == "placeholder"]
    rule = recomputable(cap.graph, fused=cuda)  # fused attention and dropout on a GPU
    plain_gm = cap.gm
    sel_gm = copy.deepcopy(cap.gm)
    rec = Recorder()
    instrument(sel_gm, rule.values, rec)
    off = Recorder()  # no instrumented node: its hooks keep every tensor (detached)
    counted = {n: Recorder(track=True) for n in ("plain", "selective")}
    instrument(counting_gm := copy.deepcopy(cap.gm), rule.values, counted["selective"])
    params = [p for p in model.parameters()]
    skip = {p.untyped_storage().data_ptr() for p in params} | {ids.untyped_storage().data_ptr()}

    def fwd(gm: Any, r: Recorder) -> Any:
        with r.saving():
            return gm(*ph)[0]

    fwd(plain_gm, counted["plain"])
    fwd(counting_gm, counted["selective"])
    bytes_plain, bytes_sel = (counted[n].kept_bytes(skip) for n in ("plain", "selective"))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    peaks: dict[str, float] = {}

    def step(gm: Any, r: Recorder) -> tuple[float, float, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        sync()
        if cuda:
            start = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = fwd(gm, r)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if cuda:
            peaks["plain" if r is off else "selective"] = torch.cuda.max_memory_allocated(dev) - start
        return t1 - t0, t2 - t1, [p.grad.clone() if p.grad is not None else None for p in params]

    step(plain_gm, off)
    step(sel_gm, rec)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "selective": []}
    grads: dict[str, list[Any]] = {}
    for i in range(a.repeats):
        order = ("plain", "selective") if i % 2 == 0 else ("selective", "plain")
        for name in order:
            f, b, g = step(plain_gm if name == "plain" else sel_gm, off if name == "plain" else rec)
            times[name].append((f, b))
            grads.setdefault(f"first {name}", g)
            grads[name] = g

    def same(x: list[Any], y: list[Any]) -> bool:
        return all((p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
                   for p, q in zip(x, y, strict=True))

    exact = same(grads["plain"], grads["selective"])
    # A GPU's kernels may sum in a different order from run to run (atomic adds): then the
    # unchanged graph run twice differs as well, and "exact" above says nothing of selective
    repeatable = same(grads["plain"], grads["first plain"])
    kept, _ = saved(cap.graph, fused=cuda)
    k = kept[:, 0] + kept[:, 1] * a.batch
    fr = rule.freed[:, 0] + rule.freed[:, 1] * a.batch
    med = {n: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v))
           for n, v in times.items()}
    return {"model": kind, "plain_mib": bytes_plain / 2**20, "sel_mib": bytes_sel / 2**20,
            "model_plain_mib": float(k.sum()) / 2**20,
            "model_sel_mib": float((k - fr).sum()) / 2**20, "values": len(rule.values),
            "fwd_plain": med["plain"][0], "bwd_plain": med["plain"][1],
            "fwd_sel": med["selective"][0], "bwd_sel": med["selective"][1], "exact": exact,
            "repeatable": repeatable,
            "peak_plain_mib": peaks.get("plain", float("nan")) / 2**20,
            "peak_sel_mib": peaks.get("selective", float("nan")) / 2**20}


def main() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama, two repeats (seconds)")
    a = p.parse_args()
    if a.smoke:
        a.models, a.layers, a.hidden, a.seq, a.batch, a.repeats = ["llama"], 1, 64, 16, 2, 2
    where = (torch.cuda.get_device_name(a.device) if a.device.startswith("cuda")
             else f"{torch.get_num_threads()} threads")
    print(f"{a.layers} layers, hidden {a.hidden}, sequence {a.seq}, batch {a.batch}, {a.dtype}, "
          f"torch {torch.__version__}, {where}, {a.repeats} repeats")
    print()
    print("| model | recipes | saved MiB, all kept | saved MiB, selective | selective / all | "
          "forecast MiB, all / selective | fwd ms | bwd ms, all kept | bwd ms, selective | "
          "added / forward | gradients bit-identical (plain run twice) | peak MiB fwd+bwd, all / selective |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in a.models:
        r = one(kind, a)
        added = (r["fwd_sel"] + r["bwd_sel"] - r["fwd_plain"] - r["bwd_plain"]) / r["fwd_plain"]
        exact = f"{'yes' if r['exact'] else 'NO'} ({'yes' if r['repeatable'] else 'no'})"
        print(f"| {kind} | {r['values']} | {r['plain_mib']:.1f} | {r['sel_mib']:.1f} | "
              f"{r['sel_mib'] / r['plain_mib']:.3f} | {r['model_plain_mib']:.1f} / "
              f"{r['model_sel_mib']:.1f} | {r['fwd_plain'] * 1e3:.1f} | {r['bwd_plain'] * 1e3:.1f} | "
              f"{r['bwd_sel'] * 1e3:.1f} | {added:+.3f} | {exact} | "
              f"{r['peak_plain_mib']:.0f} / {r['peak_sel_mib']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
