"""Plans of a fixed set of graphs as JSON, to show that a change to the planner leaves its plans
as they were (or to show exactly what it changed).

Each case plans a meta-device model (BERT, GPT-2, a ResNet, a Llama shape) with the estimate
oracle on a described cluster (homogeneous or mixed) under one Config (forced stages, replicas,
microbatches, each schedule, ZeRO-1, recomputation settings, a memory limit tight enough for the
retry on finer blocks), and writes every plan (`Plan.to_dict()`, numbers as floats so a block
index stored as 3 or as 3.0 compares equal), its `summary()`, and the error text where a case
raises. Run it before and after a change and diff the two files:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/plan_snapshot.py --out /tmp/before.json
    ... change the planner ...
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/plan_snapshot.py --out /tmp/after.json
    diff /tmp/before.json /tmp/after.json && echo identical

`--smoke` plans two small cases (seconds).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "models")]


def _bert(layers: int, hidden: int, batch: int, seq: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    from bert_factory import bert

    model, kw = bert(layers, hidden, batch, seq=seq, vocab=1024)
    return model, (), kw


def _gpt2(layers: int, hidden: int, batch: int, seq: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64),
                                       n_positions=seq, vocab_size=1000, use_cache=False))
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def _llama(layers: int, hidden: int, batch: int, seq: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch
    import transformers as tr

    cfg = tr.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         vocab_size=32000, max_position_embeddings=seq, use_cache=False)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return tr.LlamaForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}


def _resnet(batch: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch
    from resnet import bit_resnet

    from benchmarks.schedules import _WithLoss

    model = _WithLoss(bit_resnet(blocks=(2, 2), base_channels=32, num_classes=100))
    return model, (torch.empty(batch, 3, 64, 64), torch.zeros(batch, dtype=torch.long)), {}


MODELS: dict[str, Callable[[], tuple[Any, tuple[Any, ...], dict[str, Any]]]] = {
    "bert 8x256": lambda: _bert(8, 256, 64, 128),
    "gpt2 6x256": lambda: _gpt2(6, 256, 32, 256),
    "resnet (2,2)x32": lambda: _resnet(64),
    "llama 8x512": lambda: _llama(8, 512, 32, 512),
}

MIXED = [{"name": "big-fast", "memory_bytes": 32e9, "flops": 20e12, "mem_bandwidth": 1e12},
         {"name": "big-slow", "memory_bytes": 32e9, "flops": 10e12, "mem_bandwidth": 0.6e12},
         {"name": "small-fast", "memory_bytes": 16e9, "flops": 20e12, "mem_bandwidth": 1e12},
         {"name": "small-slow", "memory_bytes": 16e9, "flops": 10e12, "mem_bandwidth": 0.6e12}]

# (case name, model, cluster: (device, devices, per node) or "mixed4"/"mixed8", Config keywords)
CASES: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("bert 8 V100", "bert 8x256", ("V100-32GB", 8, 8), {"mem_limit_gb": 0.2}),
    ("bert 8 V100 roomy", "bert 8x256", ("V100-32GB", 8, 8), {}),
    ("bert 32 V100 4 nodes", "bert 8x256", ("V100-32GB", 32, 8), {"mem_limit_gb": 0.15}),
    ("bert 8 V100 k=8", "bert 8x256", ("V100-32GB", 8, 8), {"blocks": 8, "mem_limit_gb": 0.2}),
    ("bert 8 gpipe", "bert 8x256", ("V100-32GB", 8, 8), {"schedule": "gpipe", "mem_limit_gb": 0.2}),
    ("bert 8 1f1b", "bert 8x256", ("V100-32GB", 8, 8), {"schedule": "1f1b", "mem_limit_gb": 0.2}),
    ("bert 8 scp", "bert 8x256", ("V100-32GB", 8, 8), {"schedule": "scp", "mem_limit_gb": 0.2}),
    ("bert 8 partition 4", "bert 8x256", ("V100-32GB", 8, 8), {"partition_num": 4}),
    ("bert 8 replicas [3,1]", "bert 8x256", ("V100-32GB", 8, 8), {"replicas": [3, 1]}),
    ("bert 8 replicas [1,1,2] mb 8", "bert 8x256", ("V100-32GB", 8, 8),
     {"replicas": [1, 1, 2], "microbatches": 8}),
    ("bert 8 no refinement", "bert 8x256", ("V100-32GB", 8, 8),
     {"mem_limit_gb": 0.2, "extra": {"boundary_refinement": False}}),
    ("bert 4 tight memory", "bert 8x256", ("V100-32GB", 4, 4),
     {"mem_limit_gb": 0.25, "partition_num": 4}),
    ("bert 4 tight auto", "bert 8x256", ("V100-32GB", 4, 4), {"mem_limit_gb": 0.3}),
    ("bert 4 checkpointing on", "bert 8x256", ("V100-32GB", 4, 4),
     {"checkpointing": "on", "partition_num": 2}),
    ("bert 4 checkpointing off tight", "bert 8x256", ("V100-32GB", 4, 4),
     {"checkpointing": "off", "mem_limit_gb": 0.3}),
    ("bert 8 zero 1", "bert 8x256", ("V100-32GB", 8, 8), {"zero_stage": 1, "mem_limit_gb": 0.2}),
    ("bert 4 zero auto tight", "bert 8x256", ("V100-32GB", 4, 4), {"mem_limit_gb": 0.14}),
    ("bert 2 infeasible", "bert 8x256", ("V100-32GB", 2, 2), {"mem_limit_gb": 0.01}),
    ("gpt2 8 H100", "gpt2 6x256", ("H100", 8, 8), {"mem_limit_gb": 0.2}),
    ("gpt2 16 V100 2 nodes 1f1b", "gpt2 6x256", ("V100-16GB", 16, 8),
     {"schedule": "1f1b", "mem_limit_gb": 0.2}),
    ("gpt2 4 partition 2 scp", "gpt2 6x256", ("V100-32GB", 4, 4), {"partition_num": 2, "schedule": "scp"}),
    ("gpt2 mixed4", "gpt2 6x256", "mixed4", {}),
    ("gpt2 mixed4 replicas [2,2]", "gpt2 6x256", "mixed4", {"replicas": [2, 2], "microbatches": 2}),
    ("gpt2 mixed4 no balance", "gpt2 6x256", "mixed4", {"extra": {"balance": False}}),
    ("gpt2 mixed4 tight", "gpt2 6x256", "mixed4", {"mem_limit_gb": 0.2}),
    ("gpt2 mixed4 tight no balance", "gpt2 6x256", "mixed4",
     {"mem_limit_gb": 0.2, "extra": {"balance": False}}),
    ("resnet 4 V100", "resnet (2,2)x32", ("V100-32GB", 4, 4), {"mem_limit_gb": 0.012}),
    ("resnet 8 gpipe", "resnet (2,2)x32", ("V100-32GB", 8, 8), {"schedule": "gpipe", "mem_limit_gb": 0.012}),
    ("resnet mixed8", "resnet (2,2)x32", "mixed8", {"mem_limit_gb": 0.012}),
    ("llama 8 H100", "llama 8x512", ("H100", 8, 8), {"mem_limit_gb": 1.0}),
    ("llama 64 H100", "llama 8x512", ("H100", 64, 8), {}),
    ("llama 64 H100 tight", "llama 8x512", ("H100", 64, 8), {"mem_limit_gb": 0.6}),
    ("llama 8 tight", "llama 8x512", ("H100", 8, 8), {"mem_limit_gb": 0.5}),
]
SMOKE = ["bert 8 V100", "gpt2 mixed4"]


def _floats(x: Any) -> Any:
    """Every number as a float (a block index saved as 3 or 3.0 compares equal), recursively."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, dict):
        return {k: _floats(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_floats(v) for v in x]
    return repr(x)


def cluster_of(spec: Any) -> Any:
    import rannc

    if spec == "mixed4":
        return rannc.Cluster(devices=[rannc.DeviceSpec(**d) for d in MIXED], per_node=4)
    if spec == "mixed8":
        return rannc.Cluster(devices=[rannc.DeviceSpec(**d) for d in MIXED + MIXED], per_node=4)
    device, n, per_node = spec
    return rannc.Cluster.homogeneous(device, n, per_node)


def run(names: list[str]) -> dict[str, Any]:
    import torch

    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import plan_graph, plan_splits
    from rannc.profile.estimate import GraphCosts

    logging.getLogger("transformers").setLevel(logging.ERROR)
    graphs: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for name, model_name, cl, kw in [c for c in CASES if c[0] in names]:
        if model_name not in graphs:
            with torch.device("meta"):
                model, args, kwargs = MODELS[model_name]()
            cap = capture(model, args, kwargs)
            atomic = atomic_components(cap.graph)
            batch = next(x for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor)).shape[0]
            graphs[model_name] = (cap.graph, atomic, GraphCosts.of(cap.graph, atomic), batch)
        g, atomic, costs, batch = graphs[model_name]
        cluster = cluster_of(cl)
        t0 = time.perf_counter()
        try:
            plan = plan_graph(g, atomic, cluster, rannc.Config(**kw), batch_size=batch, costs=costs)
            out[name] = {"plan": _floats(plan.to_dict()), "summary": plan.summary().splitlines()}
        except rannc.RaNNCError as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if "bert 8 V100" in names:  # plan_splits, the baselines' path: one block per component run
        g, atomic, costs, batch = graphs["bert 8x256"]
        n = len(atomic.components)
        block_of = [c * 10 // n for c in range(n)]
        plans = plan_splits(g, atomic, cluster_of(("V100-32GB", 8, 8)), rannc.Config(),
                            batch_size=batch, block_of=block_of,
                            splits=[([0, 5, 10], [4, 4]), ([0, 3, 6, 8, 10], [2, 2, 2, 2]),
                                    ([0, 10], [8])], costs=costs)
        out["plan_splits"] = [None if p is None else _floats(p.to_dict()) for p in plans]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--smoke", action="store_true", help="two small cases")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    a = p.parse_args()
    names = SMOKE if a.smoke else a.cases.split(",") if a.cases else [c[0] for c in CASES]
    Path(a.out).write_text(json.dumps(run(names), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
