"""One LLM shape of `plan_quality.py --llm` planned for N devices under forced Config fields:
the plan, each stage's predicted forward, backward, recomputation and memory per microbatch,
and its time over the bound term by term (`plan_quality.over_bound`). It answers "what would
this layout or schedule give, and what limits it" for one cell of the LLM table (estimate
oracle, no GPU). A forced plan that does not fit prints the planner's error (what it needs).

    PYTHONPATH=. .venv/bin/python benchmarks/llm_plan_probe.py Gemma-7B-like --devices 8
    PYTHONPATH=. .venv/bin/python benchmarks/llm_plan_probe.py Gemma-7B-like --devices 8 \
        --config '{"schedule": "zero_bubble_v"}'
    PYTHONPATH=. .venv/bin/python benchmarks/llm_plan_probe.py --smoke   # a tiny Llama, seconds
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import rannc
from benchmarks.plan_quality import LLMS, SMOKE_LLMS, build, over_bound
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.planner import plan_graph
from rannc.profile.estimate import GraphCosts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="Gemma-7B-like", help=f"one of {list(LLMS)}")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--device", default="H100")
    p.add_argument("--config", default="{}", help="Config fields as JSON, over plan_quality's "
                   "blocks=32 and max_pipeline=32 (e.g. '{\"schedule\": \"zero_bubble_v\"}')")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on 4 devices")
    a = p.parse_args()
    name, W, per_node = a.model, a.devices, a.per_node
    catalogue = LLMS
    if a.smoke:
        catalogue, name, W, per_node = SMOKE_LLMS, next(iter(SMOKE_LLMS)), 4, 2
    kind, args = catalogue[name]
    with torch.device("meta"):
        model, margs, mkwargs, batch, _layers = build(kind, args)
    graph = capture(model, margs, mkwargs).graph
    atomic = atomic_components(graph)
    costs = GraphCosts.of(graph, atomic)
    cluster = rannc.Cluster.homogeneous(a.device, W, per_node)
    config = rannc.Config(**{"blocks": 32, "max_pipeline": 32, **json.loads(a.config)})
    bound = float(costs.component_time(cluster.slowest, batch).sum()) / W
    print(f"{name} on {W} {a.device}, global batch {batch}, Config fields {a.config}; bound "
          f"{bound:.4g} s/iteration")
    t0 = time.perf_counter()
    try:
        plan = plan_graph(graph, atomic, cluster, config, batch_size=batch, costs=costs)
    except rannc.RaNNCError as e:
        print(f"no plan ({time.perf_counter() - t0:.1f} s): {type(e).__name__}: {e}")
        return
    print(f"planned in {time.perf_counter() - t0:.1f} s: {plan.predicted_iteration_time:.4g} "
          f"s/iteration, {len(plan.stages)} stages, replicas {[s.replicas for s in plan.stages]}, "
          f"lanes {list(plan.placement())}, {plan.microbatches} microbatches, {plan.schedule}, "
          f"ZeRO-{plan.zero_stage}")
    print("stage  forward s  backward s  recompute s  weight-grad s  all-reduce s  memory GB  "
          "(per microbatch, per replica)")
    for i, st in enumerate(plan.stages):
        pr = st.predicted
        print(f"{i:5d}  {pr.forward_s:9.4f}  {pr.backward_s:10.4f}  {pr.recompute_s:11.4f}  "
              f"{pr.backward_weight_s or 0.0:13.4f}  {pr.allreduce_s:12.4f}  "
              f"{pr.memory_bytes / 1e9:9.2f}")
    terms = over_bound(plan, bound)
    print("over the bound: " + ", ".join(
        f"{k} {v:.4g} s" for k, v in terms.items() if k != "time") +
        f" (time {terms['time']:.4g} s = {terms['time'] / bound:.3f} x the bound)")


if __name__ == "__main__":
    main()
