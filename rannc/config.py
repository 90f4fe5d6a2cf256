"""rannc.Config: every setting in one dataclass; each field can also be set as RANNC_<FIELD>.

Precedence, lowest first: the field's default, the environment variable
`RANNC_<FIELD>` (e.g. `RANNC_PARTITION_NUM=2`), `config=` passed to
RaNNCModule, then keyword options passed to RaNNCModule.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rannc.errors import ConfigError

_SCHEDULES = ("auto", "gpipe", "1f1b", "scp")
_CHECKPOINTING = ("auto", "on", "off", "stage_aware")
_PROFILERS = ("auto", "measure", "estimate")
# RANNC_* variables that are not Config fields: read by rannc.dist at start-up.
LAUNCH_ENV = ("RANNC_BACKEND", "RANNC_MASTER_ADDR", "RANNC_MPI_ABORT_ON_ERROR")


@dataclass(kw_only=True, slots=True)
class Config:
    partition_num: int | None = None
    """Force the number of pipeline stages (None: the planner chooses)."""
    replicas: list[int] | None = None
    """Force each stage's replica count, e.g. [2, 1]; must sum to the ranks of one pipeline."""
    microbatches: int | None = None
    """Force the number of microbatches per iteration."""
    min_pipeline: int = 1
    """Smallest microbatch count the planner considers."""
    max_pipeline: int = 32
    """Largest microbatch count the planner considers."""
    blocks: int = 32
    """k: the number of blocks phase 2 coarsens the atomic components into, which the stage
    DP splits into stages (its time grows with k^2). After it, the chosen plans' stage
    boundaries are refined below block level, so k bounds the planning time more than the
    plan's quality (`extra={"boundary_refinement": False}` keeps whole blocks)."""
    mem_limit_gb: float | None = None
    """Per-device memory to plan for (None: the device's own)."""
    mem_margin: float = 0.1
    """Fraction of device memory kept free."""
    opt_param_factor: float | None = None
    """Optimizer state per parameter element (None: read from the optimizer, Adam = 2)."""
    schedule: str = "auto"
    """Pipeline schedule: auto (the planner picks by simulated time within memory), gpipe
    (fill-drain), 1f1b, or scp (Merak's shifted critical path)."""
    checkpointing: str = "auto"
    """Recomputation: auto, on, off or stage_aware."""
    profiler: str = "auto"
    """Cost oracle: auto, measure or estimate."""
    save_deployment: bool = False
    """Write the plan to `deployment_file` after planning."""
    load_deployment: bool = False
    """Read the plan from `deployment_file` instead of planning (rank 0 reads it and sends it to
    every rank, so the file need only exist where rank 0 runs)."""
    deployment_file: str = "rannc_deployment.json"
    """Where plans are saved and loaded."""
    profile_cache_dir: str | None = None
    """Directory for cached profiles (None: no disk cache)."""
    cluster_file: str | None = None
    """A JSON file describing the devices by hand (rannc.Cluster.load), one per rank, used
    instead of each rank measuring its own device."""
    dry_run_np: int | None = None
    """Plan for this many ranks without running (planning only)."""
    timeout_s: float = 300.0
    """Seconds before a collective that does not complete is reported as a failure."""
    seed: int | None = None
    """Seed for planning decisions and dropout replay."""
    trace: bool = False
    """Record per-rank runtime events."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Options for experimental features."""
    batchnorm: str = "local"
    """BatchNorm in training: "local" (each microbatch on each stage replica normalises over
    its own rows, as DDP without SyncBatchNorm; warned about when the plan has several) or
    "sync" (exact on the global batch: one microbatch for the whole plan, statistics summed
    over a stage's replicas in forward and backward). Running statistics follow the global
    batch, updated once per call, in both."""

    def __post_init__(self) -> None:
        for name, allowed in (("schedule", _SCHEDULES), ("checkpointing", _CHECKPOINTING),
                              ("profiler", _PROFILERS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"Config.{name}={value!r} is not one of {', '.join(allowed)}; "
                                  f"set {name} to one of them (or RANNC_{name.upper()})")
        for name in ("partition_num", "microbatches", "dry_run_np"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"Config.{name}={value} must be at least 1; give a positive "
                                  "count, or leave it unset (None) for the planner to choose")
        if self.replicas is not None and (not self.replicas or min(self.replicas) < 1):
            raise ConfigError(f"Config.replicas={self.replicas} must list at least one count, each >= 1")
        if self.blocks < 1:
            raise ConfigError(f"Config.blocks={self.blocks} must be at least 1")
        if not 0 <= self.mem_margin < 1:
            raise ConfigError(f"Config.mem_margin={self.mem_margin} must be in [0, 1)")
        if self.min_pipeline > self.max_pipeline:
            raise ConfigError(
                f"Config.min_pipeline ({self.min_pipeline}) exceeds max_pipeline ({self.max_pipeline})"
            )

    @classmethod
    def resolve(cls, config: Config | None = None, environ: Mapping[str, str] | None = None,
                **options: Any) -> Config:
        """Defaults, then RANNC_* variables, then `config`'s non-default fields, then `options`."""
        environ = os.environ if environ is None else environ
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            hints = [f"{u!r} -> {m[0]!r}" for u in unknown
                     for m in [difflib.get_close_matches(u, names, n=1)] if m]
            hint = f" Did you mean: {', '.join(hints)}?" if hints else ""
            raise ConfigError(f"unknown rannc option(s) {unknown}.{hint} Valid names: "
                              f"{sorted(names)}")
        _warn_unknown_env(environ, names)
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f"RANNC_{f.name.upper()}"
            if key in environ:
                values[f.name] = _parse_env(f.name, key, environ[key])
        if config is not None:
            default = cls()
            for f in fields(cls):
                if getattr(config, f.name) != getattr(default, f.name):
                    values[f.name] = getattr(config, f.name)
        values.update(options)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _warn_unknown_env(environ: Mapping[str, str], names: set[str]) -> None:
    """A mistyped RANNC_* variable would otherwise be ignored without a word (the run then
    plans without the setting the user thinks is on)."""
    known = {f"RANNC_{n.upper()}" for n in names} | set(LAUNCH_ENV)
    for key in sorted(k for k in environ if k.startswith("RANNC_") and k not in known):
        m = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {m[0]}? " if m else ""
        warnings.warn(f"rannc ignores the environment variable {key}: {hint}rannc reads "
                      f"{', '.join(sorted(known))}", UserWarning, stacklevel=3)


def _parse_env(name: str, key: str, text: str) -> Any:
    """RANNC_* values are JSON (numbers, lists, true/false, null) or bare strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if name in {"save_deployment", "load_deployment", "trace"} and isinstance(value, str):
        if value.lower() not in {"0", "1", "true", "false", "yes", "no"}:
            raise ConfigError(f"{key}={text!r} is not a boolean (use 1/0/true/false)")
        value = value.lower() in {"1", "true", "yes"}
    return value
