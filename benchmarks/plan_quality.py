"""Plan quality against the peers' partitioners, same costs for everyone (issue 8, study 1).

For each model (built on the meta device) and device count (8 per node, V100-32GB by default),
ONE cost table, rannc's estimate oracle (`GraphCosts`), costs every plan, and one cost model,
the planner's stage tables and schedule simulator, predicts its iteration time:
- rannc: `plan_graph`, its own blocks, stages, replicas, microbatches and schedule;
- the peers split the model's natural layer sequence (BERT: embeddings, each encoder layer,
  head; ResNet: stem, each bottleneck unit, head; GPT-2: embeddings, each block, head) with
  their own code: DeepSpeed's `partition_method` "parameters" and "uniform"
  (`deepspeed.runtime.utils.partition_balanced` / `partition_uniform`, as
  `PipelineModule._partition_layers` calls them), torchgpipe's `balance_by_time` partition
  (`torchgpipe.balance.balance_cost` on per-layer times in microseconds, as `profile_times`
  returns them; the times come from the oracle, not a GPU) and PiPPy's
  `split_into_equal_size` (torchpippy, run on an fx graph with one call_module node per layer);
- a peer runs S stages x W/S data-parallel copies (uniform replicas, all it can express), for
  every S dividing the W devices, and keeps the fastest S that fits memory; each split gets the
  planner's own microbatch-count and schedule search (`rannc.planner.plan_splits`), so the
  peers differ from rannc in the split and the replica counts only;
- the bound: the whole batch's forward + backward compute time on one device / W (no plan
  is faster: a plan adds bubbles, recomputation, imbalance, reductions and smaller kernels);
- with --llm, a second table per device count: each baseline's time over the bound, the most
  any plan could gain over it (where it is below the goal's ratio, no plan meets the goal),
  and every plan's time over the bound term by term (`over_bound`).

Peers are imported from the benchmark environment (`bash scripts/bench_env.sh`); where one is
not installed its column says so. Prints one Markdown table per device count, the machine and
the date, and draws `docs/plan_quality.png`.

    bash scripts/bench_env.sh
    PYTHONPATH=. .venv-bench/bin/python benchmarks/plan_quality.py
    PYTHONPATH=. .venv/bin/python benchmarks/plan_quality.py --smoke   # tiny models, no peers needed
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "models")]

# DeepSpeed probes for CUDA/XPU/NPU... when imported; on a CPU-only machine it falls back to its
# CPU accelerator with a warning. Naming it skips the probe (only its partition functions are used).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

PEERS = ("DeepSpeed parameters", "DeepSpeed uniform", "torchgpipe time", "PiPPy equal size")

# name -> (builder key, arguments); the global batch is part of the model's inputs
MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "BERT-Large 24x1024": ("bert", (24, 1024, 256, 128)),
    "BERT 96x1024": ("bert", (96, 1024, 256, 128)),
    "BERT 24x2048": ("bert", (24, 2048, 256, 128)),
    "BERT 256x2048": ("bert", (256, 2048, 256, 128)),
    "ResNet50x1": ("resnet", (50, 1, 512, 224)),
    "ResNet101x4": ("resnet", (101, 4, 512, 224)),
    "ResNet152x8": ("resnet", (152, 8, 512, 224)),
    "GPT-2 24x1024": ("gpt2", (24, 1024, 64, 512)),
    "GPT-2 48x1600": ("gpt2", (48, 1600, 64, 1024)),
}
# LLM shapes (--llm): (layers, hidden, intermediate, heads, kv heads, vocab, global batch in
# sequences, sequence length, experts); Gemma-7B-like uses Gemma's head_dim 256 (16 heads x 256
# is wider than its hidden 3072, as in Gemma-7B), Mixtral routes each token to 2 of 8 experts.
LLMS: dict[str, tuple[str, tuple[int, ...]]] = {
    "Llama-3-8B": ("llama", (32, 4096, 14336, 32, 8, 128256, 64, 4096, 0)),
    "Llama-3-70B": ("llama", (80, 8192, 28672, 64, 8, 128256, 64, 4096, 0)),
    "Gemma-7B-like": ("gemma", (28, 3072, 24576, 16, 16, 256000, 64, 4096, 0)),
    "Mixtral-8x7B": ("mixtral", (32, 4096, 14336, 32, 8, 32000, 64, 4096, 8)),
}
# the LLM table's baselines: torchtitan's default equal-layer split, a FLOPs-balanced layer
# split (torchtitan's auto-partition balances layer costs), DeepSpeed's parameter-count split
LLM_BASELINES = ("equal layers", "FLOPs balanced", "parameter count")
SMOKE_LLMS: dict[str, tuple[str, tuple[int, ...]]] = {
    "Llama 2x64": ("llama", (2, 64, 128, 4, 2, 128, 8, 16, 0)),
}
SMOKE: dict[str, tuple[str, tuple[int, ...]]] = {
    "BERT 2x64": ("bert", (2, 64, 16, 16)),
    "ResNet (1, 1)x1": ("resnet", (0, 1, 32, 16)),
    "GPT-2 2x64": ("gpt2", (2, 64, 16, 32)),
}


# -- models and their layer sequences ---------------------------------------------------------

Layers = list[list[str]]  # per layer, the module paths it holds (in forward order)


def build(kind: str, a: tuple[int, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any], int, Layers]:
    """(model on meta, args, kwargs, global batch, layers) for a MODELS entry."""
    import torch

    with torch.device("meta"):
        if kind == "bert":
            from bert_factory import bert

            L, H, batch, seq = a
            vocab = 128 if H < 256 else 30522
            model, kw = bert(L, H, batch, seq=seq, vocab=vocab)
            layers = ([["bert.embeddings"]] + [[f"bert.encoder.layer.{i}"] for i in range(L)]
                      + [["bert.pooler", "cls"]])
            return model, (), kw, batch, layers
        if kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            L, H, batch, seq = a
            vocab = 128 if H < 256 else 50257
            model = GPT2LMHeadModel(GPT2Config(n_layer=L, n_embd=H, n_head=max(1, H // 64),
                                               n_positions=seq, vocab_size=vocab, use_cache=False))
            ids = torch.zeros(batch, seq, dtype=torch.long)
            layers = ([["transformer.wte", "transformer.wpe", "transformer.drop"]]
                      + [[f"transformer.h.{i}"] for i in range(L)] + [["transformer.ln_f", "lm_head"]])
            return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}, batch, layers
        if kind in ("llama", "gemma", "mixtral"):
            return _llm(kind, a)
        from resnet import bit_resnet

        from benchmarks.schedules import _WithLoss

        depth, width, batch, px = a
        net = (bit_resnet(depth, width) if depth else
               bit_resnet(blocks=(1, 1), base_channels=8, num_classes=10))
        model = _WithLoss(net)
        x = (torch.empty(batch, 3, px, px), torch.zeros(batch, dtype=torch.long))
        layers = [["net.root"]]
        for i, stage in enumerate(net.body):
            layers += [[f"net.body.{i}.units.{j}"] for j in range(len(stage.units))]
        layers.append(["net.norm", "net.relu", "net.pool", "net.head"])
        return model, x, {}, batch, layers


def _llm(kind: str, a: tuple[int, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any], int, Layers]:
    """A Hugging Face decoder LLM of the given shape (on the meta device: the caller's
    `torch.device("meta")`) returning its loss alone (`_LossOnly`), called on input_ids and
    labels; layers: embeddings, each decoder layer, final norm + LM head."""
    import torch
    import transformers as tr

    L, H, inter, heads, kv, vocab, batch, seq, experts = a
    common = dict(num_hidden_layers=L, hidden_size=H, intermediate_size=inter,
                  num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                  max_position_embeddings=seq, use_cache=False)
    if kind == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**common))
    elif kind == "gemma":
        model = tr.GemmaForCausalLM(tr.GemmaConfig(**common, head_dim=256))
    else:
        model = tr.MixtralForCausalLM(tr.MixtralConfig(**common, num_local_experts=experts,
                                                       num_experts_per_tok=2))
    ids = torch.zeros(batch, seq, dtype=torch.long)
    layers = ([["lm.model.embed_tokens", "lm.model.rotary_emb"]]
              + [[f"lm.model.layers.{i}"] for i in range(L)] + [["lm.model.norm", "lm.lm_head"]])
    return _LossOnly(model), (), {"input_ids": ids, "labels": ids}, batch, layers


class _LossOnly(__import__("torch").nn.Module):  # type: ignore[misc]
    """The LLM returning its loss alone, as a training loop reads it and as torchtitan's last
    stage computes it: a Hugging Face causal LM also returns its logits, which rannc holds
    until the call returns (the memory model counts them: 64 x 4096 x 128,256 fp32 logits are
    134 GB of one global batch, so no plan of these shapes would fit at 8 or 16 devices)."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Any, labels: Any) -> Any:
        return self.lm(input_ids=input_ids, labels=labels).loss


def minmax_bounds(weights: Sequence[float], S: int) -> list[int] | None:
    """Bounds of the contiguous split of `weights` into S non-empty parts whose largest sum is
    smallest (exact DP; what DeepSpeed's `partition_balanced` and torchgpipe's `balance_cost`
    approximate), or None when there are fewer weights than parts."""
    n = len(weights)
    if S > n:
        return None
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + float(w))
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(S + 1)]
    cut = [[0] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], pre[j] - pre[i])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [n], n
    for s in range(S, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    return bounds[::-1]


def llm_splitters(model: Any, layers: Layers, times_us: list[int]) -> dict[str, Split | str]:
    """The LLM table's baselines (see LLM_BASELINES)."""
    n = len(layers)
    params = layer_params(model, layers)

    def equal(S: int) -> list[int] | None:
        # torchtitan's default: the decoder layers (and the embedding and head as one layer
        # each) spread evenly, the first stages taking one more when S does not divide
        if S > n:
            return None
        q, r = divmod(n, S)
        return [i * q + min(i, r) for i in range(S + 1)]

    return {"equal layers": equal,
            "FLOPs balanced": lambda S: minmax_bounds(times_us, S),
            "parameter count": lambda S: minmax_bounds(params, S)}


def layer_of_components(graph: Any, atomic: Any, layers: Layers) -> list[int]:
    """Each atomic component's layer: the layer holding its module path; a component outside
    every layer (the model's own glue: masks, the loss) joins the layer before it. Raises if the
    components do not run layer after layer, since a stage must be a run of layers."""
    owner = {path: i for i, paths in enumerate(layers) for path in paths}
    out, cur = [], 0
    for c in atomic.components:
        path = graph.tasks[c.task].module_path or ""
        parts = path.split(".")
        hit = next((owner[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                    if ".".join(parts[:n]) in owner), None)
        if hit is not None:
            if hit < cur:
                raise RuntimeError(f"component {c.index} ({path}) of layer {hit} runs after layer "
                                   f"{cur}: the layer sequence does not follow the graph")
            cur = hit
        out.append(cur)
    missing = sorted(set(range(len(layers))) - set(out))
    if missing:
        raise RuntimeError(f"layers {missing} ({[layers[i] for i in missing]}) hold no component")
    return out


def layer_params(model: Any, layers: Layers, buffers: bool = False) -> list[int]:
    """Trainable parameter elements per layer (tied ones counted in each layer holding them,
    as DeepSpeed's `_count_layer_params` does), plus buffers when asked."""
    out = []
    for paths in layers:
        seen: dict[int, int] = {}
        for p in paths:
            mod = model.get_submodule(p)
            for t in mod.parameters():
                if t.requires_grad:
                    seen[id(t)] = t.numel()
            if buffers:
                for t in mod.buffers():
                    seen[id(t)] = t.numel()
        out.append(sum(seen.values()))
    return out


# -- the peers' partitioners (their own code) --------------------------------------------------

Split = Callable[[int], list[int] | None]  # stages -> layer bounds (None: it cannot make S stages)


def peer_splitters(model: Any, layers: Layers, times_us: list[int]) -> dict[str, Split | str]:
    """Each peer's split function, or why it is missing."""
    n = len(layers)
    out: dict[str, Split | str] = {}
    try:
        from deepspeed.runtime.utils import partition_balanced, partition_uniform
    except ImportError:
        out["DeepSpeed parameters"] = out["DeepSpeed uniform"] = "not installed"
    else:
        params = layer_params(model, layers)
        out["DeepSpeed parameters"] = lambda S: [int(x) for x in partition_balanced(params, S)]
        out["DeepSpeed uniform"] = lambda S: [int(x) for x in partition_uniform(n, S)]
    try:
        from torchgpipe.balance import balance_cost
    except ImportError:
        out["torchgpipe time"] = "not installed"
    else:
        def gpipe(S: int) -> list[int]:
            counts = balance_cost(times_us, S)
            return [sum(counts[:i]) for i in range(S + 1)]
        out["torchgpipe time"] = gpipe
    try:
        from pippy.ModelSplit import split_into_equal_size
    except ImportError:
        out["PiPPy equal size"] = "not installed"
    else:
        out["PiPPy equal size"] = lambda S: _pippy_bounds(split_into_equal_size(S), model, layers)
    return out


def _pippy_bounds(split: Callable[[Any], Any], model: Any, layers: Layers) -> list[int] | None:
    """Run PiPPy's split pass on an fx graph with one call_module node per layer and read where
    it put `pipe_split`. PiPPy counts a call_module's parameters (not buffers) as a whole."""
    import torch
    from torch import fx

    root = torch.nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    for i, paths in enumerate(layers):
        root.add_module(f"layer{i}", torch.nn.ModuleList([model.get_submodule(p) for p in paths]))
        x = g.call_module(f"layer{i}", (x,))
    g.output(x)
    try:
        gm = split(fx.GraphModule(root, g))
    except AssertionError:  # PiPPy asserts it made the stages asked for
        return None
    bounds, seen = [0], 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            seen += 1
        elif node.op == "call_function" and getattr(node.target, "__name__", "") == "pipe_split":
            bounds.append(seen)
    return bounds + [len(layers)]


# -- one model ---------------------------------------------------------------------------------

def one(name: str, kind: str, a: tuple[int, ...], device: str, worlds: Sequence[int],
        per_node: int, blocks: int = 32, max_pipeline: int = 32) -> dict[str, Any]:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import plan_graph, plan_splits
    from rannc.profile.estimate import GraphCosts

    t0 = time.perf_counter()
    model, args, kw, batch, layers = build(kind, a)
    params = sum(p.numel() for p in model.parameters())
    g = capture(model, args, kw).graph
    at = atomic_components(g)
    costs = GraphCosts.of(g, at)
    layer_of = layer_of_components(g, at, layers)
    res: dict[str, Any] = {"model": name, "params_b": params / 1e9, "layers": len(layers),
                           "components": len(at.components), "batch": batch, "worlds": {},
                           "capture_s": time.perf_counter() - t0}
    for W in worlds:
        cluster = rannc.Cluster.homogeneous(device, W, per_node)
        spec = cluster.slowest
        cfg = rannc.Config(blocks=blocks, max_pipeline=max_pipeline)
        row: dict[str, Any] = {}
        t_world = time.perf_counter()
        try:
            p = plan_graph(g, at, cluster, cfg, batch_size=batch, costs=costs)
            row["rannc"] = {"time": p.predicted_iteration_time, "m": p.microbatches,
                            "schedule": p.schedule, "replicas": [st.replicas for st in p.stages],
                            "zero": p.zero_stage}
            rannc_plan = p
        except rannc.PlanInfeasibleError as e:
            row["rannc"] = {"status": f"no plan fits ({e.needed_bytes / 1e9:.0f} GB needed)"}
            rannc_plan = None
        comp_t = costs.component_time(spec, max(1, batch // W))
        times_us = [0] * len(layers)
        for c, lay in enumerate(layer_of):
            times_us[lay] += int(comp_t[c] * 1e6)
        llm = kind in ("llama", "gemma", "mixtral")
        splitters = (llm_splitters if llm else peer_splitters)(model, layers, times_us)
        best: dict[str, dict[str, Any]] = {}
        for S in [s for s in range(1, W + 1) if W % s == 0 and s <= len(layers)]:
            splits: dict[str, list[int]] = {}
            for peer, fn in splitters.items():
                if callable(fn):
                    b = fn(S)  # DeepSpeed and PiPPy may leave a stage empty: not a split
                    if b is not None and len(b) == S + 1 and all(
                            x < y for x, y in zip(b, b[1:], strict=False)):
                        splits[peer] = b
            distinct = sorted({tuple(b) for b in splits.values()})
            # the LLM baselines get ZeRO-1 too where it is faster, as rannc's zero_stage "auto"
            for zcfg in (cfg, dataclasses.replace(cfg, zero_stage=1)) if llm else (cfg,):
                plans = plan_splits(g, at, cluster, zcfg, batch_size=batch, block_of=layer_of,
                                    splits=[(list(b), [W // S] * S) for b in distinct], costs=costs)
                by_split = dict(zip(distinct, plans, strict=True))
                for peer, b in splits.items():
                    pl = by_split[tuple(b)]
                    if pl is not None and (peer not in best
                                           or pl.predicted_iteration_time < best[peer]["time"]):
                        best[peer] = {"time": pl.predicted_iteration_time, "S": S,
                                      "m": pl.microbatches, "schedule": pl.schedule, "bounds": b,
                                      "zero": pl.zero_stage, "plan": pl}
        for peer in (LLM_BASELINES if llm else PEERS):
            fn = splitters[peer]
            row[peer] = best.get(peer, {"status": fn if isinstance(fn, str) else "no split fits"})
        row["bound"] = float(costs.component_time(spec, batch).sum()) / W
        if llm:  # each plan's time over the bound, term by term (`over_bound`)
            for who, pl in [("rannc", rannc_plan), *((x, row[x].get("plan")) for x in LLM_BASELINES)]:
                if pl is not None:
                    row[who]["terms"] = over_bound(pl, row["bound"])
        for x in LLM_BASELINES if llm else PEERS:
            row[x].pop("plan", None)
        row["seconds"] = time.perf_counter() - t_world
        res["worlds"][str(W)] = row
    return res


# -- rannc's time over the bound, term by term -------------------------------------------------

# The terms `over_bound` splits a plan's predicted seconds per iteration into, beyond the bound.
TERMS = ("microbatch", "recompute", "imbalance", "bubble", "reduction")


def over_bound(plan: Any, bound: float) -> dict[str, float]:
    """A plan's predicted iteration time as the bound plus five terms (seconds), from its own
    per-stage predictions and the planner's simulator (the terms sum to the simulated time,
    returned as "time", which is the plan's predicted time):
    - microbatch: the devices' mean compute (forward + backward without recomputation, p2p
      transfers included, at the plan's rows per microbatch) less the bound (the same compute
      at the whole batch): kernels on small microbatches are less efficient;
    - recompute: the devices' mean recomputation seconds (a recomputed prefix's and selective
      recomputation's rebuilds);
    - imbalance: the busiest lane's compute less the devices' mean;
    - bubble: the simulated iteration without gradient reduction less the busiest lane's
      compute (the schedule's idle time on the critical lane);
    - reduction: what the gradient all-reduce (and ZeRO-1's all-gather) adds to it."""
    from rannc.schedule import StageCosts, chain, make_schedule, simulate

    m, W = plan.microbatches, plan.world_size
    pr = [st.predicted for st in plan.stages]
    reps = [st.replicas for st in plan.stages]
    busy = [m * (p.forward_s + p.backward_s) for p in pr]  # per replica, recomputation in
    rec = [m * (p.recompute_s + (p.selective_s or 0.0)) for p in pr]
    mean = sum(r * b for r, b in zip(reps, busy, strict=True)) / W
    mean_rec = sum(r * x for r, x in zip(reps, rec, strict=True)) / W
    lane = plan.placement()
    slowest = max(sum(b for b, d in zip(busy, lane, strict=True) if d == x) for x in set(lane))
    S = len(pr)
    sched = make_schedule(plan.schedule, m, chain(S),
                          [(p.recompute_memory_fraction or 0.0) > 0 for p in pr], lane)

    def simulated(reduce: bool) -> float:
        costs = StageCosts(fwd=[p.forward_s for p in pr],
                           bwd=[p.backward_s - p.recompute_s for p in pr],
                           recompute=[p.recompute_s for p in pr], comm_fwd=[0.0] * S,
                           comm_bwd=[0.0] * S,
                           allreduce=[p.allreduce_s if reduce else 0.0 for p in pr],
                           wgrad=[p.backward_weight_s or 0.0 for p in pr])
        return simulate(sched, costs).iteration_time

    t, t0 = simulated(True), simulated(False)
    return {"time": t, "microbatch": mean - mean_rec - bound, "recompute": mean_rec,
            "imbalance": slowest - mean, "bubble": t0 - slowest, "reduction": t - t0}


# -- report ------------------------------------------------------------------------------------

def cell(r: dict[str, Any]) -> str:
    if "time" not in r:
        return r["status"]
    if "S" in r:  # a peer: S stages x W/S replicas each
        zero = ", ZeRO-1" if r.get("zero") else ""
        return f"{r['time']:.4g} (S={r['S']}, m={r['m']}, {r['schedule']}{zero})"
    reps = r["replicas"]
    stages = f"{len(reps)} stage{'' if len(reps) == 1 else 's'}"
    shape = f"{stages} x {reps[0]}" if len(set(reps)) == 1 else f"replicas {reps}"
    zero = ", ZeRO-1" if r.get("zero") else ""
    return f"{r['time']:.4g} ({shape}, m={r['m']}, {r['schedule']}{zero})"


def table(results: list[dict[str, Any]], W: int) -> list[str]:
    out = [f"**{W} devices**", "",
           "| model | params (B) | layers | rannc s/iter | " + " | ".join(f"{p} s/iter" for p in PEERS)
           + " | bound s/iter | best peer / rannc | rannc / bound |",
           "|---" * (7 + len(PEERS)) + "|"]
    for r in results:
        row = r["worlds"][str(W)]
        if "equal layers" in row:
            continue  # an LLM row: llm_table
        rt = row["rannc"].get("time")
        peers = [row[p]["time"] for p in PEERS if "time" in row[p]]
        best = min(peers) if peers else None
        ratio = f"{best / rt:.3f}" if rt and best else "n/a"
        bound = f"{rt / row['bound']:.2f}" if rt else "n/a"
        out.append(f"| {r['model']} | {r['params_b']:.2f} | {r['layers']} | {cell(row['rannc'])} | "
                   + " | ".join(cell(row[p]) for p in PEERS)
                   + f" | {row['bound']:.4g} | {ratio} | {bound} |")
    return out


def llm_table(results: list[dict[str, Any]], W: int) -> list[str]:
    """The LLM table: rannc against each baseline (ratio > 1: rannc faster) and the bound."""
    out = [f"**{W} devices**", "",
           "| model | params (B) | rannc s/iter | " + " | ".join(f"{p} s/iter" for p in LLM_BASELINES)
           + " | bound s/iter | " + " | ".join(f"{p} / rannc" for p in LLM_BASELINES)
           + " | rannc / bound | planning s |",
           "|---" * (6 + 2 * len(LLM_BASELINES)) + "|"]
    for r in results:
        row = r["worlds"].get(str(W))
        if row is None or "equal layers" not in row:
            continue
        rt = row["rannc"].get("time")
        ratios = [f"{row[p]['time'] / rt:.3f}" if rt and "time" in row[p] else "n/a"
                  for p in LLM_BASELINES]
        bound = f"{rt / row['bound']:.3f}" if rt else "n/a"
        out.append(f"| {r['model']} | {r['params_b']:.2f} | {cell(row['rannc'])} | "
                   + " | ".join(cell(row[p]) for p in LLM_BASELINES)
                   + f" | {row['bound']:.4g} | " + " | ".join(ratios)
                   + f" | {bound} | {row.get('seconds', float('nan')):.0f} |")
    return out


def llm_ceiling_table(results: list[dict[str, Any]], W: int) -> list[str]:
    """Why a goal is or is not reachable: no plan is faster than the bound (the whole batch's
    compute on one device over W: every term of `over_bound` is >= 0), so a baseline's time over
    the bound is the most any plan can gain over that baseline (the ceiling); where it is below
    the goal's 1.2x (equal layers) or 1.05x (FLOPs balanced), no plan meets that goal. Then
    each plan's seconds over the bound, term by term (`over_bound`; percent of the bound)."""
    out = [f"**{W} devices: the ceilings (baseline / bound) and each plan over the bound**", "",
           "| model | plan | s/iter | / bound | "
           + " | ".join(f"{t} s (% of bound)" for t in (*TERMS, "other"))
           + " | most any plan gains over it | goal reachable? |",
           "|---" * (7 + len(TERMS)) + "|"]
    goal = {"equal layers": 1.2, "FLOPs balanced": 1.05}
    for r in results:
        row = r["worlds"].get(str(W))
        if row is None or "equal layers" not in row:
            continue
        bound = row["bound"]
        for who in ("rannc", *LLM_BASELINES):
            x = row[who]
            if "time" not in x:
                out.append(f"| {r['model']} | {who} | {x['status']} |" + " |" * (5 + len(TERMS)))
                continue
            terms = dict(x.get("terms", {}))
            if terms:  # what the plan's own time differs from the re-simulation by (none: 0)
                terms["other"] = x["time"] - terms["time"]
            cells = [f"{terms[t]:.3g} ({100 * terms[t] / bound:.1f})" if t in terms else "n/a"
                     for t in (*TERMS, "other")]
            ceiling = x["time"] / bound
            if who in goal:
                reach = f"{'yes' if ceiling >= goal[who] else 'no'} ({goal[who]}x needed)"
                gain = f"{ceiling:.3f}x"
            else:
                reach, gain = "", ""
            out.append(f"| {r['model']} | {who} | {x['time']:.4g} | {ceiling:.3f} | "
                       + " | ".join(cells) + f" | {gain} | {reach} |")
    return out


def plot(results: list[dict[str, Any]], worlds: Sequence[int], path: Path, title: str,
         llm: bool = False) -> None:
    """Each plan's predicted time over the bound, per model and device count: rannc's and the
    peers' (or, `llm`, the LLM baselines')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(len(worlds), 1, figsize=(11, 3.6 * len(worlds)), squeeze=False)
    names = ["rannc", *(LLM_BASELINES if llm else PEERS)]
    width = 0.8 / len(names)
    for ax, W in zip(axes[:, 0], worlds, strict=True):
        for j, who in enumerate(names):
            xs, ys = [], []
            for i, r in enumerate(results):
                row = r["worlds"][str(W)]
                if "time" in row.get(who, {}):
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(row[who]["time"] / row["bound"])
            ax.bar(xs, ys, width, label=who)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(results)), [r["model"] for r in results], fontsize=8)
        ax.set_ylabel("predicted s/iter / bound")
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%.2f"))  # (not 1.2 x 10^0)
        ax.set_title(f"{W} devices ({title})", fontsize=9)
        ax.legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny models on 4 devices, seconds")
    p.add_argument("--models", default=None, help="comma-separated names of MODELS")
    p.add_argument("--device", default="V100-32GB")
    p.add_argument("--devices", default="8,32", help="device counts")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--blocks", type=int, default=32, help="rannc's k (Config.blocks)")
    p.add_argument("--max-pipeline", type=int, default=32, help="Config.max_pipeline, the most "
                   "microbatches rannc and the baselines' microbatch search try")
    p.add_argument("--plot", default=None, help="PNG path (default docs/plan_quality.png; none "
                   "with --smoke unless given)")
    p.add_argument("--results", default=None, help="a folder for each model's raw results: "
                   "written as each model finishes and reused when present (resumable)")
    p.add_argument("--llm", action="store_true", help="the LLM shapes (LLMS) against the "
                   "equal-layer, FLOPs-balanced and parameter-count splits; use --device H100")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    catalogue = ((SMOKE_LLMS if a.llm else SMOKE) if a.smoke else LLMS if a.llm else MODELS)
    worlds = [4] if a.smoke else [int(x) for x in a.devices.split(",")]
    per_node = 2 if a.smoke else a.per_node
    if a.one:
        kind, args = catalogue[a.one]
        print(json.dumps(one(a.one, kind, args, a.device, worlds, per_node, a.blocks,
                             a.max_pipeline)))
        return
    names = list(catalogue) if a.models is None else a.models.split(",")
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {list(catalogue)}")
    print(f"machine: {machine()}; date: {datetime.date.today()}; costs: rannc's estimate oracle "
          f"({a.device}, {per_node} per node), not a GPU; rannc k = {a.blocks} blocks; "
          f"max_pipeline {a.max_pipeline}; python: "
          f"{sys.executable}", flush=True)
    results = []
    for name in names:
        if a.smoke:  # tiny models: in this process, seconds
            kind, args = catalogue[name]
            results.append(one(name, kind, args, a.device, worlds, per_node, a.blocks,
                               a.max_pipeline))
            continue
        tag = f"{name.replace(' ', '_')}_{a.device}_{'-'.join(map(str, worlds))}"
        tag += "" if a.blocks == 32 else f"_k{a.blocks}"
        tag += "" if a.max_pipeline == 32 else f"_m{a.max_pipeline}"
        saved = Path(a.results) / f"{tag}.json" if a.results else None
        if saved is not None and saved.exists():
            results.append(json.loads(saved.read_text()))
            continue
        # a fresh process per model: captures of the largest take GBs
        cmd = [sys.executable, __file__, "--one", name, "--device", a.device, *(["--llm"] * a.llm),
               "--devices", ",".join(map(str, worlds)), "--per-node", str(a.per_node),
               "--blocks", str(a.blocks), "--max-pipeline", str(a.max_pipeline)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0 and a.llm:  # report it and go on with the other shapes
            print(f"{name} failed:\n{out.stderr[-1500:]}", flush=True)
            continue
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(results[-1]))
        print(f"done: {name}", file=sys.stderr, flush=True)
    for W in worlds:
        print("\n".join(["", *(llm_table if a.llm else table)(results, W)]), flush=True)
        if a.llm:
            print("\n".join(["", *llm_ceiling_table(results, W)]), flush=True)
    if a.llm:
        for r in results:
            print(f"{r['model']}: capture {r['capture_s']:.0f} s, "
                  + ", ".join(f"{W} devices {row['seconds']:.0f} s" for W, row in r["worlds"].items()))
    path = a.plot or (None if a.smoke or a.llm else str(ROOT / "docs" / "plan_quality.png"))
    if path:
        plot(results, worlds, Path(path), f"{a.device}, estimate oracle, {datetime.date.today()}",
             llm=a.llm)
        print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
