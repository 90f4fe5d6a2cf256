"""Plans on a mixed cluster (devices of different speeds and memories).

Two ways, and the planner keeps the faster (`rannc.planner`):
- `place`: a plan made for the cluster's weakest device (the homogeneous search) put on the
  real devices: earlier stages, which hold more microbatches' activations, on the devices with
  more memory, and each stage's rows split among its replicas by speed within memory (Whale's
  balancing, `shares.whale_shares`);
- `mixed_plans`: the mixed-cluster DP (`hetero.py`), one pipeline over all devices, each stage
  costed on its own devices, for a few microbatch counts and every schedule.

Index conventions: r a rank; s a stage; m microbatches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.config import Config
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan, StagePlan, StagePrediction, param_names_of
from rannc.profile.device import Cluster
from rannc.profile.estimate import BlockProfile
from rannc.schedule import get_spec
from rannc.stage_dp.assemble import module_range
from rannc.stage_dp.hetero import HeteroDevices, HeteroStage, hetero_stages
from rannc.stage_dp.memory import (
    MB,
    MemoryModel,
    bucket_memory,
    rows_scaled,
    rows_that_fit,
)
from rannc.stage_dp.search import selective_allowed
from rannc.stage_dp.shares import finish_time, whale_shares
from rannc.stage_dp.tables import BlockIO, batch_per_replica, reduction_overlaps_backward

MIXED_DP_MAX = 16  # devices; the mixed-cluster DP is O(blocks^2 devices^2) in Python


def mixed_dp_enabled(cluster: Cluster, config: Config) -> bool:
    """Whether the planner runs the mixed-cluster DP (extra hetero_dp=False or balance=False
    turn it off, for benchmarks)."""
    return (not cluster.is_homogeneous and cluster.size <= MIXED_DP_MAX
            and bool(config.extra.get("hetero_dp", True))
            and bool(config.extra.get("balance", True)))


def hetero_devices(cluster: Cluster, config: Config) -> HeteroDevices:
    """Each rank's effective speed and the memory a stage may use on it."""
    cap = config.mem_limit_gb * 1e9 if config.mem_limit_gb is not None else None
    return HeteroDevices(speed=[d.flops * d.efficiency for d in cluster.devices],
                         memory=[(cap if cap is not None else d.memory_bytes) * (1 - config.mem_margin)
                                 for d in cluster.devices])


def mixed_plans(graph: TaskGraph, atomic: AtomicPartition, prof: BlockProfile, io: BlockIO,
                static: np.ndarray, cluster: Cluster, config: Config, block_of: Sequence[int],
                batch_size: int, microbatches: Sequence[int], schedules: Sequence[str],
                late: bool, link_bw: float) -> list[Plan]:
    """Plans from the mixed-cluster DP (`stage_dp.hetero`), one pipeline over all devices,
    for each of `microbatches` and each schedule (forced replicas honoured)."""
    from rannc.schedule.predict import predict

    world = cluster.size
    dev = hetero_devices(cluster, config)
    ar_bw = cluster.inter_node_bandwidth if cluster.nodes > 1 else link_bw
    out = []
    if config.replicas is not None and sum(config.replicas) != world:
        return []  # pipeline copies: not in the mixed-cluster DP yet
    for m in microbatches:
        if m > batch_size or m > config.max_pipeline and config.microbatches is None:
            continue
        if config.microbatches is not None and m != config.microbatches:
            continue
        batch_of = [0] + [batch_per_replica(batch_size, 1, m, d) for d in range(1, world + 1)]
        # the DP's split for each distinct memory bound: schedules holding alike share one
        # (1F1B and scp do; the DP is this planner's slowest step, in Python)
        split: dict[tuple[int, int, int, bool], list[HeteroStage] | None] = {}
        for sched in schedules:
            if get_spec(sched).chunks > 1:
                continue  # the mixed-cluster DP places one stage per device group
            held = get_spec(sched).held(world, m, late)
            key = (held.in_flight, held.saved_inputs, held.pending,
                   reduction_overlaps_backward(sched))
            if key not in split:
                split[key] = hetero_stages(
                    prof, io, static, dev, rows=batch_size / m, batch_of=batch_of,
                    in_flight=held.in_flight, saved=held.saved_inputs, link_bw=link_bw,
                    allreduce_bw=ar_bw, microbatches=m, checkpointing=config.checkpointing,
                    stages=config.partition_num, replicas=config.replicas,
                    bucket_bytes=config.bucket_mb * MB, overlap=key[3],
                    selective=selective_allowed(config), pending=held.pending)
            hs = split[key]
            if hs is None:
                continue
            stages = []
            for s, h in enumerate(hs):
                comps = tuple(c for c, b in enumerate(block_of) if h.first_block <= b <= h.last_block)
                total = sum(h.rows)
                stages.append(StagePlan(
                    index=s, components=comps, ranks=h.devices,
                    shares=tuple(x / total for x in h.rows), recompute=1.0 if h.recompute else 0.0,
                    param_names=param_names_of(graph, atomic, comps),
                    predicted=StagePrediction(
                        forward_s=h.forward_s, backward_s=h.backward_s, recompute_s=h.recompute_s,
                        allreduce_s=h.allreduce_s, memory_bytes=h.memory_bytes,
                        microbatch_rows=max(h.rows), first_block=h.first_block,
                        last_block=h.last_block, selective_s=h.selective_s),
                    modules=module_range(graph, atomic, comps),
                    devices=tuple(cluster.devices[r].name for r in h.devices),
                    selective=h.selective))
            plan = Plan(stages=tuple(stages), microbatches=m, world_size=world,
                        fingerprint=graph.fingerprint(), schedule=sched, batch_size=batch_size,
                        blocks=max(block_of) + 1, source=(graph, atomic))
            out.append(dataclasses.replace(plan, predicted_iteration_time=predict(plan).iteration_time))
    return out


def place(plan: Plan, cluster: Cluster, dev: HeteroDevices, io: BlockIO, mem: MemoryModel,
          balance: bool = True) -> Plan:
    """Place a plan made for the cluster's weakest device on its real devices: earlier
    stages (which hold more microbatches' activations) on the devices with more memory, and
    each stage's rows split among its replicas by speed within memory (`whale_shares`); the
    predicted stage times and iteration time follow. `io`: the tables of the groups the plan's
    block indices name; a replica's memory beyond its stage's static part (parameters, their
    state and the gradient bucket: all of the optimizer state, as the mixed-cluster DP counts
    it; and the rank's overhead) scales with its rows. `balance=False`: equal shares in rank
    order, what a planner that assumes identical devices would run. Under an interleaved
    schedule a device's stages share it: each is placed within 1/chunks of its memory, as it
    was planned."""
    from rannc.schedule.predict import predict

    speed, capacity = dev.speed, dev.memory
    # (under an accumulation an eager schedule holds the gradients twice)
    static = mem.scheduled(get_spec(plan.schedule).eager).static(io.params, io.grad_params, 1, 0)
    order = dev.order() if balance else list(range(cluster.size))
    slow = min(speed)
    share = get_spec(plan.schedule).chunks  # stages sharing each device
    stages = []
    for st in plan.stages:
        ranks = tuple(order[r] for r in st.ranks)
        p = st.predicted
        assert p is not None  # the search predicted every stage
        rows = p.microbatch_rows  # what the plan gave each replica on the weakest device
        total = rows * st.replicas
        lo, hi = p.first_block, p.last_block
        fixed = float(static[lo, hi] + bucket_memory(
            io.grad_params[lo, hi], io.shared_grad[lo, hi], io.shared_count()[lo, hi],
            st.replicas > 1, mem.bucket_bytes))
        caps = [rows_that_fit(p.memory_bytes, fixed, rows, capacity[r] / share) for r in ranks]
        x = whale_shares(total, [speed[r] for r in ranks], caps) if balance else [rows] * len(ranks)
        factor = finish_time(x, [speed[r] for r in ranks]) / (rows / slow)
        j = max(range(len(ranks)),
                key=lambda i: rows_scaled(p.memory_bytes, fixed, rows, x[i])
                - capacity[ranks[i]] / share)
        placed = dataclasses.replace(p, forward_s=p.forward_s * factor,
                                     backward_s=p.backward_s * factor,
                                     recompute_s=p.recompute_s * factor,
                                     backward_weight_s=None if p.backward_weight_s is None
                                     else p.backward_weight_s * factor,
                                     memory_bytes=rows_scaled(p.memory_bytes, fixed, rows, x[j]))
        stages.append(dataclasses.replace(st, ranks=ranks, shares=tuple(v / total for v in x),
                                          predicted=placed,
                                          devices=tuple(cluster.devices[r].name for r in ranks)))
    out = dataclasses.replace(plan, stages=tuple(stages))
    return dataclasses.replace(out, predicted_iteration_time=predict(out).iteration_time)


__all__ = ["MIXED_DP_MAX", "hetero_devices", "mixed_dp_enabled", "mixed_plans", "place"]
