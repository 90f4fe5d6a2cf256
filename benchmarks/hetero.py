"""Mixed clusters (issue 7, estimate oracle): rannc's plan with Whale-style row shares against the
same plan run as if the devices were identical (equal shares, ranks in order), both evaluated
with every device's own speed.

    PYTHONPATH=. .venv/bin/python benchmarks/hetero.py

BERT-Large (24 x 1024, batch 256 x 128) and a GPT-2-style model (24 x 1024, batch 64 x 512) on
4 x V100-32GB + 4 x P100-16GB (one node), ResNet-50 (batch 1024 x 224^2) data parallel on
8 x V100-32GB + 8 x P100-16GB (two nodes, replicas forced to one stage). Stage splits and
replica counts still come from the DP over the weakest device (the device-aware DP is open).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "models")]


def models(smoke: bool) -> list[tuple[str, Any, tuple[Any, ...], dict[str, Any], int, list[str],
                                 dict[str, Any]]]:
    import torch
    from bert_factory import bert
    from resnet import bit_resnet
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.schedules import _WithLoss

    # (the smoke run plans for 4 and 8 devices: it checks that the script runs, and the
    # hetero search over 8 and 16 took 110 s of CI)
    mixed8 = ["V100-32GB"] * 2 + ["P100"] * 2 if smoke else ["V100-32GB"] * 4 + ["P100"] * 4
    mixed16 = ["V100-32GB"] * 4 + ["P100"] * 4 if smoke else ["V100-32GB"] * 8 + ["P100"] * 8
    with torch.device("meta"):
        if smoke:  # tiny sizes, to check the script runs
            b, bkw = bert(2, 64, 16, seq=16, vocab=128)
            g = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32,
                                           vocab_size=128, use_cache=False))
            ids = torch.zeros(16, 32, dtype=torch.long)
            r = _WithLoss(bit_resnet(blocks=(1, 1), base_channels=8, num_classes=10))
            rx = (torch.empty(32, 3, 16, 16), torch.zeros(32, dtype=torch.long))
            b2, b2kw = bert(2, 64, 16, seq=16, vocab=128)
            sizes = (16, 16, 32, 16)
        else:
            b, bkw = bert(24, 1024, 256)
            g = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=512,
                                           use_cache=False))
            ids = torch.zeros(64, 512, dtype=torch.long)
            r = _WithLoss(bit_resnet(50, 1))
            rx = (torch.empty(1024, 3, 224, 224), torch.zeros(1024, dtype=torch.long))
            b2, b2kw = bert(24, 2048, 256)  # 1.3 B parameters: too big for data parallel on P100
            sizes = (256, 64, 1024, 256)
    return [("BERT-Large", b, (), bkw, sizes[0], mixed8, {}),
            ("GPT-2 24x1024", g, (), {"input_ids": ids, "labels": ids, "use_cache": False}, sizes[1],
             mixed8, {}),
            ("ResNet-50 data parallel", r, rx, {}, sizes[2], mixed16, {"replicas": [len(mixed16)]}),
            ("BERT 24x2048 (pipeline)", b2, (), b2kw, sizes[3], mixed8, {})]


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import plan_graph

    print("| model | cluster | rannc plan (stages x replicas, microbatches, schedule) | shares of "
          "stage 0 | predicted s/iter: rannc | shares only (DP on the weakest device) | equal "
          "shares | rannc vs equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model, args, kwargs, batch, devices, force in models(smoke):
        cap = capture(model, args, kwargs)
        atomic = atomic_components(cap.graph)
        cluster = rannc.Cluster(devices, per_node=min(8, len(devices)))
        times = {}
        plans = {}
        for mode, extra in (("rannc", {}), ("shares", {"hetero_dp": False}),
                            ("equal", {"balance": False})):
            cfg = rannc.Config(extra=extra, **force)
            p = plan_graph(cap.graph, atomic, cluster, cfg, batch_size=batch)
            times[mode], plans[mode] = p.predicted_iteration_time, p
        p = plans["rannc"]
        lay = f"{[st.replicas for st in p.stages]}, {p.microbatches}, {p.schedule}"
        sh = ", ".join(f"{d}:{x:.3f}" for d, x in sorted(set(zip(p.stages[0].devices,
                                                                  p.stages[0].shares, strict=True))))
        n = len(devices)
        print(f"| {name} | {n // 2} x V100-32GB + {n // 2} x P100 | {lay} | {sh} | "
              f"{times['rannc']:.3f} | {times['shares']:.3f} | {times['equal']:.3f} | "
              f"{times['equal'] / times['rannc']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
