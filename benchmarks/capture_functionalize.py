"""What functionalising the captured graph costs at capture time.

    PYTHONPATH=. .venv/bin/python benchmarks/capture_functionalize.py --layers 24 --repeats 3

Builds BERT (hidden 1024, the given number of layers) on the meta device and times, alternating
in one process, torch.export alone and torch.export followed by `run_decompositions({})` (the
functionalisation rannc's capture now does so that writes through views are kept).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.export import Dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(hidden_size=1024, num_hidden_layers=a.layers, num_attention_heads=16,
                     intermediate_size=4096)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
        ids = torch.zeros(2, 128, dtype=torch.long)
    dyn = {"input_ids": {0: Dim("batch", min=1)}}
    plain, func = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        ep = torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=dyn, strict=False)
        t1 = time.perf_counter()
        ep.run_decompositions({})
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        func.append(t2 - t0)
    print(f"BERT {a.layers}x1024 on meta, {a.repeats} repeats (median): export "
          f"{statistics.median(plain):.2f} s, export + functionalise {statistics.median(func):.2f} s "
          f"({statistics.median(func) / statistics.median(plain):.2f}x)")


if __name__ == "__main__":
    main()
