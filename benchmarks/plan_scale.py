"""Planning wall time with the estimate oracle for enlarged BERT (issue 4).

For each size, in a fresh process: build BertForPreTraining on the meta device, capture it,
and plan it for 32 devices, 8 per node (default V100-32GB), global batch 256 x 128 tokens.
Prints one Markdown row per model: parameters, atomic components, blocks, seconds per step,
peak RSS.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_scale.py [--sizes 24x1024,256x2048]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SIZES = ["24x1024", "96x1024", "256x1024", "24x2048", "96x2048", "256x2048"]


def one(size: str, device: str, devices: int, per_node: int, batch: int) -> dict[str, object]:
    import logging

    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)
    sys.path.insert(0, "examples/models")
    from bert_factory import bert

    import rannc
    from rannc.planner import PlanStats

    layers, hidden = (int(x) for x in size.split("x"))
    t0 = time.perf_counter()
    with torch.device("meta"):
        model, kwargs = bert(layers, hidden, batch)
    params = sum(p.numel() for p in model.parameters())
    stats = PlanStats()
    plan = rannc.plan(model, (), kwargs, cluster=rannc.Cluster.homogeneous(device, devices, per_node),
                      stats=stats)
    wall = time.perf_counter() - t0
    return {"size": size, "params_b": params / 1e9, "components": stats.components,
            "blocks": stats.blocks, "seconds": stats.seconds, "wall": wall,
            "stages": len(plan.stages), "microbatches": plan.microbatches,
            "replicas": [st.replicas for st in plan.stages],
            "predicted_s": plan.predicted_iteration_time,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--device", default="V100-32GB")
    p.add_argument("--devices", type=int, default=32)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.device, a.devices, a.per_node, a.batch)))
        return
    print("| layers x hidden | params (B) | atomic components | blocks | capture s | plan s "
          "(costs + blocks + profile + stage DP) | wall s | stages x replicas, microbatches | "
          "predicted s/iter | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in a.sizes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", size, "--device", a.device,
                              "--devices", str(a.devices), "--per-node", str(a.per_node),
                              "--batch", str(a.batch)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        s = r["seconds"]
        planning = sum(v for k, v in s.items() if k != "capture")
        print(f"| {r['size']} | {r['params_b']:.2f} | {r['components']} | {r['blocks']} | "
              f"{s['capture']:.1f} | {planning:.2f} ({s['costs']:.2f} + {s['blocks']:.2f} + "
              f"{s['profile']:.2f} + {s['stage_dp']:.2f}) | {r['wall']:.1f} | "
              f"{r['replicas']}, {r['microbatches']} | {r['predicted_s']:.2f} | {r['rss_mb']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
