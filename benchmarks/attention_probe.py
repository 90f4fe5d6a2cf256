"""What rannc's captured graph runs for attention, against eager PyTorch: the attention
operators each dispatches to, the bytes autograd saves and the peak of a forward and backward;
then, per dtype and form of mask, what one attention call keeps (`kernels`).

    PYTHONPATH=. python benchmarks/attention_probe.py            # one CUDA GPU (else the CPU)
    PYTHONPATH=. .venv/bin/python benchmarks/attention_probe.py --smoke

Hugging Face BERT, GPT-2 and Llama from configs (`benchmarks/gpu_memory.build`), random weights,
training mode, called with input_ids and labels only. Per model: the attention-related operators
of the captured graph and of an eager forward (a dispatch mode logs every aten call), then the
distinct storages `saved_tensors_hooks` sees (parameters left out) and, on a GPU, the peak
allocated during forward + backward, eager and captured (second of two rounds). On the H100 of
2026-11-27 this showed the captured BERT running the unfused math attention where eager ran the
memory-efficient kernel (BENCHMARKS.md, "One H100 and 16 cores"); `rannc.graph.capture`'s
`_dense_attention_masks` is the fix.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_memory as g  # noqa: E402

from rannc.graph.capture import capture, flatten_inputs  # noqa: E402

KEYS = ("attention", "softmax", "bmm", "matmul", "dropout", "baddbmm", "where", "masked", "expand")


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def attention_ops(ops: collections.Counter[str]) -> dict[str, int]:
    return {k: v for k, v in sorted(ops.items()) if any(s in k for s in KEYS)}


def measure(fn: Callable[[], torch.Tensor], params: list[torch.Tensor],
            dev: torch.device) -> tuple[float, float]:
    """(MiB autograd saves, MiB peak allocated during forward + backward; nan on the CPU)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = t.untyped_storage().data_ptr()
        if k not in skip and k not in seen:
            seen.add(k)
            total[0] += t.untyped_storage().nbytes()
        return t

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    peak = (torch.cuda.max_memory_allocated(dev) - start) / 2**20 if cuda else float("nan")
    return total[0] / 2**20, peak


def probe(kind: str, a: argparse.Namespace, dev: torch.device) -> None:
    net = g.build(kind, a).to(dev).train()
    kw = g.batch(a, a.batch, dev)
    cap = capture(net, (), kw)
    graph_ops = collections.Counter(str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function")
    leaves, _ = flatten_inputs((), kw)
    env = cap.bind(net, leaves)
    ph = [env.get(n.name) for n in cap.gm.graph.nodes if n.op == "placeholder"]
    params = list(net.parameters())
    runs: dict[str, Callable[[], torch.Tensor]] = {"eager": lambda: net(**kw).loss,
                                                  "captured": lambda: cap.gm(*ph)[0]}
    sizes: dict[str, tuple[float, float]] = {}
    for _ in range(2):  # the second round's figures: the first warms the allocator's caches
        for name, fn in runs.items():
            for q in params:
                q.grad = None
            sizes[name] = measure(fn, params, dev)
    dispatched = {}
    for name, fn in runs.items():
        with OpLog() as log:
            fn()
        dispatched[name] = attention_ops(log.ops)
    print(f"{kind}: captured graph {attention_ops(graph_ops)}")
    for name in runs:
        print(f"  dispatched, {name}: {dispatched[name]}")
    print(f"  saved MiB eager {sizes['eager'][0]:.1f}, captured {sizes['captured'][0]:.1f}; forward + "
          f"backward peak MiB eager {sizes['eager'][1]:.0f}, captured {sizes['captured'][1]:.0f}",
          flush=True)


MASKS = ("none", "is_causal", "bool", "bool broadcast", "float")


def kernels(a: argparse.Namespace, dev: torch.device) -> None:
    """One `scaled_dot_product_attention` per (dtype, form of the mask): the kernel it
    dispatches to and the bytes autograd keeps beyond q, k, v and the output, in units of one
    batch x queries x keys element table. What `rannc.profile.saved` needs to know before it
    counts a mask: a captured graph passes a materialised boolean mask where eager passes none
    or `is_causal`, and if the kernel keeps that mask converted to an additive bias, every
    layer holds one more such table (the GPT-2 probe of 2026-11-27 saved one float32 table a
    layer more than eager; a bf16 Llama none)."""
    heads, d = max(1, a.hidden // 64), 64
    b, s = a.batch, a.seq
    table = b * s * s  # elements of one batch x queries x keys table
    dtypes = [torch.float32] + ([torch.bfloat16] if dev.type == "cuda" else [])
    print(f"\nOne attention call, batch {b}, {heads} heads, {s} queries and keys, head dim {d}: "
          f"what autograd keeps beyond q, k, v and the output, in tables of {b} x {s} x {s} "
          "elements (bytes / elements)\n")
    print("| dtype | mask | kernel | kept bytes / table elements |\n|---|---|---|---|")
    for dt in dtypes:
        for form in MASKS:
            q, k, v = (torch.randn(b, heads, s, d, device=dev, dtype=dt, requires_grad=True)
                       for _ in range(3))
            causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
            mask: torch.Tensor | None = None
            if form == "bool":
                mask = causal.expand(b, 1, s, s).contiguous()
            elif form == "bool broadcast":
                mask = causal[None, None]
            elif form == "float":
                mask = torch.zeros(b, 1, s, s, device=dev, dtype=dt).masked_fill(~causal, float("-inf"))
            skip = {t.untyped_storage().data_ptr() for t in (q, k, v)}
            if mask is not None:
                skip.add(mask.untyped_storage().data_ptr())
            kept: dict[int, int] = {}

            def pack(t: torch.Tensor, skip: set[int] = skip, kept: dict[int, int] = kept) -> torch.Tensor:
                st = t.untyped_storage()
                if st.data_ptr() not in skip:
                    kept[st.data_ptr()] = st.nbytes()
                return t

            with OpLog() as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=form == "is_causal")
            skip.add(out.untyped_storage().data_ptr())
            kept.pop(out.untyped_storage().data_ptr(), None)
            kernel = next((k for k in log.ops if "attention" in k and "scaled_dot_product_attention."
                           not in k), "math (" + ", ".join(k for k in log.ops if "softmax" in k) + ")")
            print(f"| {str(dt).replace('torch.', '')} | {form} | {kernel} | "
                  f"{sum(kept.values()) / table:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=g.MODELS, default=list(g.MODELS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (seconds)")
    p.add_argument("--no-kernels", action="store_true", help="skip the one-call kernel table")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.layers, a.hidden, a.vocab, a.seq, a.batch = ["bert"], 1, 64, 128, 16, 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    print(f"device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; "
          f"torch {torch.__version__}; L{a.layers} H{a.hidden}, batch {a.batch} x {a.seq}\n")
    for kind in a.models:
        probe(kind, a, dev)
    if not a.no_kernels:
        kernels(a, dev)

if __name__ == "__main__":
    main()
