"""What the planner knows about hardware: `DeviceSpec` (one accelerator) and `Cluster` (devices
grouped into nodes, with the bandwidth inside and between nodes).

The table holds vendor peak figures; `efficiency` scales them to what dense kernels reach in
practice, so the roofline estimate (`rannc.profile.estimate`) is in seconds rather than in
ideal units. `measure_local_device()` times a matrix product and a copy on this machine, for
planning the hardware you are running on rather than a table entry.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rannc.errors import ConfigError

GB = 1e9
GiB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """What the planner knows of a device: usable memory, peak FLOP/s and memory bandwidth
    (the estimate oracle's roofline), link bandwidth within a node, and the host time per op
    that a GPU overlaps with its own (`host_per_op`: where ops are short, a block of the graph
    takes its ops' host time rather than its device time). `rannc.KNOWN_DEVICES`
    holds vendor figures by name (`"V100-32GB"`, `"A100-80GB"`, `"H100"`, ...); describe
    another device with these fields (also in a cluster file)."""

    name: str
    memory_bytes: float  # usable device memory
    flops: float  # peak fp32 FLOP/s (dense)
    mem_bandwidth: float  # device memory bytes/s
    flops_half: float = 0.0  # peak fp16/bf16 FLOP/s with tensor cores (0: same as fp32)
    link_bandwidth: float = 16 * GB  # bytes/s to a device on the same node (NVLink/PCIe)
    efficiency: float = 0.6  # fraction of peak that real kernels reach
    op_overhead: float = 5e-6  # seconds per kernel launch (forward; backward pays about twice)
    # Seconds of host time per graph op that runs on the device, forward (backward: about twice
    # per differentiable op): dispatch, autograd, autocast's casts and the stage graph's Python,
    # taken as a whole. A device that runs asynchronously (a GPU) overlaps it with its own work,
    # so a block of the graph takes the larger of its device time and its ops' host time
    # (`GraphCosts.block_profile`). 0: the host time is in the device time (a CPU). The GPU
    # entries' 40 us was measured with torch 2.11 on the H100 and H200 hosts the project was
    # lent: BERT-Large's forward and backward in bf16 took 48.7 ms on the H200 (46.9 on the
    # H100) for 391 forward and 375 differentiable ops, 42.6 us an op pass (BENCHMARKS.md).
    host_per_op: float = 0.0

    def key(self) -> str:
        """A stable identity for caches: every field, since a measured spec differs by run."""
        return "|".join(f"{k}={v}" for k, v in asdict(self).items())


# The host time per op on a GPU (`DeviceSpec.host_per_op`).
GPU_HOST_PER_OP = 40e-6


def _gpu(name: str, memory_bytes: float, flops: float, mem_bandwidth: float, *, flops_half: float,
         link_bandwidth: float) -> DeviceSpec:
    return DeviceSpec(name, memory_bytes, flops, mem_bandwidth, flops_half=flops_half,
                      link_bandwidth=link_bandwidth, host_per_op=GPU_HOST_PER_OP)


# Vendor figures (SXM parts where both exist). Memory is what a process can allocate, a little
# under the marketing figure.
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _gpu("P100", 16 * GiB * 0.97, 9.3e12, 732 * GB, flops_half=18.7e12,
             link_bandwidth=20 * GB),
        _gpu("V100-16GB", 16 * GiB * 0.97, 15.7e12, 900 * GB, flops_half=125e12,
             link_bandwidth=25 * GB),
        _gpu("V100-32GB", 32 * GiB * 0.97, 15.7e12, 900 * GB, flops_half=125e12,
             link_bandwidth=25 * GB),
        _gpu("T4", 15 * GiB, 8.1e12, 320 * GB, flops_half=65e12, link_bandwidth=12 * GB),
        _gpu("A100-40GB", 40 * GiB * 0.97, 19.5e12, 1555 * GB, flops_half=312e12,
             link_bandwidth=300 * GB),
        _gpu("A100-80GB", 80 * GiB * 0.97, 19.5e12, 2039 * GB, flops_half=312e12,
             link_bandwidth=300 * GB),
        _gpu("H100", 80 * GiB * 0.97, 67e12, 3350 * GB, flops_half=989e12,
             link_bandwidth=450 * GB),
        _gpu("H200", 141 * GB * 0.97, 67e12, 4800 * GB, flops_half=989e12,
             link_bandwidth=450 * GB),
    )
}


def device_spec(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    key = name_or_spec.upper().replace("_", "-")
    for name, spec in KNOWN_DEVICES.items():
        if name.upper() == key:
            return spec
    if key in ("LOCAL", "CPU", "CUDA"):
        return measure_local_device()
    raise ConfigError(f"unknown device {name_or_spec!r}; use one of {', '.join(KNOWN_DEVICES)} or "
                      "'local', or pass a rannc.DeviceSpec")


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices in rank order; ranks [k*per_node, (k+1)*per_node) share node k."""

    devices: tuple[DeviceSpec, ...]
    per_node: int
    inter_node_bandwidth: float = 12.5 * GB  # 100 Gb/s InfiniBand, as in the paper's cluster

    def __init__(self, devices: Sequence[DeviceSpec | str], per_node: int | None = None,
                 inter_node_bandwidth: float = 12.5 * GB) -> None:
        devs = tuple(device_spec(d) for d in devices)
        if not devs:
            raise ConfigError("a Cluster needs at least one device")
        per = len(devs) if per_node is None else per_node
        if per < 1 or len(devs) % per:
            raise ConfigError(f"per_node={per_node} must be >= 1 and divide the {len(devs)} devices")
        object.__setattr__(self, "devices", devs)
        object.__setattr__(self, "per_node", per)
        object.__setattr__(self, "inter_node_bandwidth", float(inter_node_bandwidth))

    @classmethod
    def homogeneous(cls, device: str | DeviceSpec = "V100-32GB", n: int = 32, per_node: int = 8,
                    inter_node_bandwidth: float = 12.5 * GB) -> Cluster:
        """`n` devices of one kind (a KNOWN_DEVICES name, "local" for this machine's measured
        device, or a DeviceSpec), `per_node` to a node."""
        if n < 1:
            raise ConfigError(f"a cluster needs n >= 1 devices, got {n}")
        spec = device_spec(device)
        return cls([spec] * n, per_node=min(per_node, n), inter_node_bandwidth=inter_node_bandwidth)

    @classmethod
    def from_reports(cls, reports: Sequence[DeviceSpec], per_node: int,
                     inter_node_bandwidth: float = 12.5 * GB) -> Cluster:
        """The cluster the ranks measured, in rank order. Devices with the same name get one
        spec (the mean of their measured speeds, the least memory), so measurement noise does
        not make identical devices look different to the planner."""
        by_name: dict[str, list[DeviceSpec]] = {}
        for d in reports:
            by_name.setdefault(d.name, []).append(d)
        merged = {}
        for name, ds in by_name.items():
            n = len(ds)
            merged[name] = dataclasses.replace(
                ds[0], flops=sum(d.flops for d in ds) / n,
                mem_bandwidth=sum(d.mem_bandwidth for d in ds) / n,
                flops_half=sum(d.flops_half for d in ds) / n,
                memory_bytes=min(d.memory_bytes for d in ds))
        return cls([merged[d.name] for d in reports], per_node=per_node,
                   inter_node_bandwidth=inter_node_bandwidth)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """A cluster described by hand, as JSON: {"per_node": 4, "devices": ["V100-32GB",
        {"name": "slow", "memory_bytes": 8e9, "flops": 7e12, "mem_bandwidth": 4.5e11}, ...]}
        (names from KNOWN_DEVICES or full DeviceSpec fields), one entry per rank in rank order."""
        import json

        try:
            with open(path) as f:
                d = json.load(f)
            devs = [x if isinstance(x, str) else DeviceSpec(**x) for x in d["devices"]]
            return cls(devs, per_node=d.get("per_node"),
                       inter_node_bandwidth=d.get("inter_node_bandwidth", 12.5 * GB))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot read the cluster file {os.fspath(path)!r}: {e}; it should be "
                              'JSON like {"per_node": 4, "devices": ["V100-32GB", ...]}') from e

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def is_homogeneous(self) -> bool:
        return all(d == self.devices[0] for d in self.devices)

    @property
    def slowest(self) -> DeviceSpec:
        """The device with the least effective FLOP/s: what a synchronous pipeline waits for."""
        return min(self.devices, key=lambda d: d.flops * d.efficiency)

    def key(self) -> str:
        return f"{self.per_node}/{self.inter_node_bandwidth}/" + ";".join(
            sorted({d.key() for d in self.devices}))


def _host_memory_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


_LOCAL: DeviceSpec | None = None


def measure_local_device() -> DeviceSpec:
    """This process's device (the current CUDA device, else the CPU), measured once per process:
    FLOP/s of a square fp32 matrix product (on CUDA also a bf16 one, for autocast graphs),
    bytes/s of a large copy, and its memory. Peak figures are what is measured, so
    `efficiency` is 1."""
    global _LOCAL
    if _LOCAL is not None:
        return _LOCAL
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = 2048 if cuda else 512
    # Constant operands: the timing does not depend on the values, and drawing random ones
    # would move the user's RNG stream (planning runs inside the first forward call).
    a = torch.full((n, n), 0.5, device=dev)
    b = torch.full((n, n), 0.25, device=dev)
    big = torch.empty(32 * (1 << 20) // 4 * (8 if cuda else 1), device=dev)

    def timed(fn: object, reps: int) -> float:
        best = float("inf")
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()  # type: ignore[operator]
            if cuda:
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    mm = timed(lambda: a @ b, 10 if cuda else 3)
    # A CPU has no tensor cores: its bf16 products are no faster, so 0 (price them at fp32).
    mm_half = 0.0
    if cuda:
        ah, bh = a.bfloat16(), b.bfloat16()
        mm_half = timed(lambda: ah @ bh, 10)
    cp = timed(lambda: big.clone(), 5)
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        mem, name = float(props.total_memory) * 0.95, f"local-{props.name}"
    else:
        mem, name = _host_memory_bytes(), "local-cpu"
    _LOCAL = DeviceSpec(name=name, memory_bytes=mem, flops=2 * n**3 / mm,
                        flops_half=2 * n**3 / mm_half if mm_half else 0.0,
                        mem_bandwidth=2 * big.numel() * 4 / cp, efficiency=1.0,
                        op_overhead=5e-6 if cuda else 2e-6, link_bandwidth=(16 if cuda else 4) * GB,
                        host_per_op=GPU_HOST_PER_OP if cuda else 0.0)
    return _LOCAL
