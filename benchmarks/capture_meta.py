"""Capture a large Hugging Face BERT (BertForPreTraining) on the meta device and report costs.

The model's parameters are never allocated (`meta` tensors carry shapes and dtypes only), so
a multi-billion-parameter model captures on a laptop. Prints the parameter count, torch.export
seconds, total wall seconds, the task graph's size, the process's peak RSS and, when
`rannc.atomic.components.atomic_components` is available, the number of atomic components;
then the same figures as a Markdown table row.

    PYTHONPATH=. .venv/bin/python benchmarks/capture_meta.py            # 48 x 2048, ~2.5 B
    PYTHONPATH=. .venv/bin/python benchmarks/capture_meta.py --layers 2 --hidden 256 --heads 4
    PYTHONPATH=. .venv/bin/python benchmarks/capture_meta.py --smoke   # 2 x 64, seconds
"""

from __future__ import annotations

import argparse
import importlib
import resource
import sys
import time
from typing import Any

import torch

from rannc.graph.capture import capture


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48, help="encoder layers (default 48)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--heads", type=int, default=32, help="attention heads (default 32)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="feed-forward size (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=30522, help="vocabulary size (default 30522)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--smoke", action="store_true", help="a tiny BERT (2 x 64), seconds")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.hidden, a.heads, a.vocab, a.seq = 2, 64, 2, 128, 16
    return a


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def count_components(graph: Any) -> tuple[str, str]:
    """The number of atomic components and the seconds taken to form them, as text.

    Both are "n/a" where `rannc.atomic.components.atomic_components` does not exist.
    """
    try:
        mod = importlib.import_module("rannc.atomic.components")
    except ImportError:
        return "n/a", "n/a"
    fn = getattr(mod, "atomic_components", None)
    if fn is None:
        return "n/a", "n/a"
    t0 = time.perf_counter()
    n = len(fn(graph).components)
    return str(n), f"{time.perf_counter() - t0:.2f}"


def main(argv: list[str] | None = None) -> None:
    """Build the model on the meta device, capture it and print the figures."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        max_position_embeddings=max(512, args.seq),
    )
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    b, s = args.batch, args.seq
    kwargs = {
        "input_ids": torch.zeros(b, s, dtype=torch.long, device="meta"),
        "attention_mask": torch.ones(b, s, dtype=torch.long, device="meta"),
        "token_type_ids": torch.zeros(b, s, dtype=torch.long, device="meta"),
        "labels": torch.zeros(b, s, dtype=torch.long, device="meta"),
        "next_sentence_label": torch.zeros(b, dtype=torch.long, device="meta"),
    }
    captured = capture(model, (), kwargs)
    graph = captured.graph
    wall = time.perf_counter() - t_start  # import + build + capture
    components, comp_seconds = count_components(graph)
    rss = peak_rss_mb()

    name = f"BertForPreTraining L{args.layers} H{args.hidden} A{args.heads}"
    print(f"model:            {name}, batch {b}, seq {s}, meta device")
    print(f"parameters:       {n_params / 1e9:.3f} B ({n_params:,})")
    print(f"export seconds:   {captured.seconds:.1f}")
    print(f"wall seconds:     {wall:.1f} (transformers import + meta build + capture)")
    print(f"tasks:            {len(graph.tasks)}")
    print(f"values:           {len(graph.values)}")
    print(f"atomic components: {components} ({comp_seconds} s)")
    print(f"peak RSS (MB):    {rss:.0f}")
    print()
    print("| model | params (B) | batch x seq | export s | wall s | tasks | values "
          "| atomic components | components s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {name} | {n_params / 1e9:.3f} | {b} x {s} | {captured.seconds:.1f} | {wall:.1f} "
          f"| {len(graph.tasks)} | {len(graph.values)} | {components} | {comp_seconds} "
          f"| {rss:.0f} |")


if __name__ == "__main__":
    main()
