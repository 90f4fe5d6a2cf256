"""Which cost oracle the planner asks: the roofline estimate (`rannc.profile.oracle`) or
measurements on this process's device (`rannc.profile.measure`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rannc.atomic.components import AtomicPartition
from rannc.config import Config
from rannc.profile.device import Cluster
from rannc.profile.estimate import GraphCosts
from rannc.profile.oracle import BlockOracle, EstimateOracle
from rannc.progress import NO_PROGRESS, Progress


def make_oracle(cfg: Config, cap: Any, atomic: AtomicPartition, model: Any, leaves: Sequence[Any],
                costs: GraphCosts, cluster: Cluster, progress: Progress = NO_PROGRESS) -> BlockOracle:
    """`profiler`: `estimate` always; `measure` runs blocks on this process's device (the model
    must be materialised there); `auto` measures when the model's parameters live on a CUDA
    device and estimates otherwise (CPU timings of a busy host mislead more than they help, and
    a meta model cannot run)."""
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    use = cfg.profiler
    if use == "auto":
        use = "measure" if device.type == "cuda" else "estimate"
    if use == "estimate":
        return EstimateOracle(costs, cluster)  # array arithmetic: nothing to show
    from rannc.profile.measure import MeasureOracle

    return MeasureOracle(cap, atomic, model, leaves, device, costs, cluster.slowest,
                         cache_dir=cfg.profile_cache_dir, progress=progress)


__all__ = ["make_oracle"]
