"""Imbalance handling (issue 4): BERT whose vocabulary projection dominates, planned for 4
devices on one node with the estimate oracle; the slowest stage against the ideal
(total forward+backward time / devices). The test `test_a_dominant_last_layer_is_balanced_by_replicas`
asserts the 1.25x bound; this prints the figures.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_balance.py
    PYTHONPATH=. .venv/bin/python benchmarks/plan_balance.py --smoke   # 2 layers, 2 rows
"""

from __future__ import annotations

import logging
import sys

import torch

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.profile.estimate import GraphCosts


def main() -> None:
    from transformers import BertConfig, BertForPreTraining

    logging.getLogger("transformers").setLevel(logging.ERROR)
    smoke = "--smoke" in sys.argv[1:]  # fewer layers and partition counts: seconds
    cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=2 if smoke else 4,
                     num_attention_heads=2, intermediate_size=512)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    kw = {k: torch.zeros(32, 128, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    spec = rannc.DeviceSpec("test", 16e9, 10e12, 1e12, op_overhead=0.0, link_bandwidth=1e15)
    cluster = rannc.Cluster.homogeneous(spec, n=4, per_node=4)
    cap = capture(model, (), kw)
    costs = GraphCosts.of(cap.graph, atomic_components(cap.graph))
    total = float(costs.component_time(spec, 8).sum())
    top = float(costs.component_time(spec, 8).max())
    print(f"largest atomic component: {top / total:.1%} of the model's time")
    print("| partition_num | stages (replicas) | slowest stage ms | ideal ms | slowest / ideal |")
    print("|---|---|---|---|---|")
    for pn in (None, 2) if smoke else (None, 2, 3, 4):
        plan = rannc.plan(model, (), kw, cluster=cluster,
                          config=rannc.Config(partition_num=pn, checkpointing="off", microbatches=4))
        slowest = max(st.predicted["forward_s"] + st.predicted["backward_s"] for st in plan.stages)
        reps = ", ".join(str(st.replicas) for st in plan.stages)
        print(f"| {pn or 'auto'} | {len(plan.stages)} ({reps}) | {slowest * 1e3:.3f} | "
              f"{total / 4 * 1e3:.3f} | {slowest / (total / 4):.2f} |")


if __name__ == "__main__":
    main()
