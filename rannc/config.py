"""rannc.Config: every setting in one dataclass; each field can also be set as RANNC_<FIELD>.

Precedence, lowest first: the field's default, the environment variable
`RANNC_<FIELD>` (e.g. `RANNC_PARTITION_NUM=2`), `config=` passed to
RaNNCModule, then keyword options passed to RaNNCModule.

Every field is checked against its declared type and range when a Config is made, from
keywords and environment alike: a bad value is a `ConfigError` naming the field (or the
variable), the value and what to give instead -- never a TypeError deep in planning.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rannc.errors import ConfigError
from rannc.schedule.spec import SCHEDULES


def _schedules() -> tuple[str, ...]:
    """Read when a value is checked, so a schedule registered later is accepted too."""
    return ("auto", *SCHEDULES)


_CHECKPOINTING = ("auto", "on", "off", "stage_aware", "selective")
_PROFILERS = ("auto", "measure", "estimate")
# How a yes or a no is spelt in a RANNC_* variable (a boolean field's, or a switch's).
_YES, _NO = ("1", "true", "yes"), ("0", "false", "no")
# A switch field's other spellings, from keywords (True) and the environment ("1", "true").
_SWITCH: dict[bool | str, str] = {True: "on", False: "off", **dict.fromkeys(_YES, "on"),
                                   **dict.fromkeys(_NO, "off")}
# RANNC_* variables that are not Config fields: read by rannc.dist at start-up.
LAUNCH_ENV = ("RANNC_BACKEND", "RANNC_MASTER_ADDR", "RANNC_MPI_ABORT_ON_ERROR")
# RaNNC's own variables that rannc does not read, with what to use instead. A spelling match
# alone would mislead here: RANNC_MAX_PARTITION_NUM is closest to RANNC_PARTITION_NUM, but one
# caps the stage count and the other forces it.
RANNC_ORIGINAL_ENV = {
    "RANNC_MAX_PARTITION_NUM": "it capped the stage count, and rannc has no cap: leave "
                               "RANNC_PARTITION_NUM unset for the planner to choose, or set it to "
                               "force an exact stage count",
    "RANNC_MIN_PARTITION_NUM": "rannc has no lower bound on the stage count: set "
                               "RANNC_PARTITION_NUM to force an exact count",
    "RANNC_PARTITIONING_DRY_RUN_NP": "use RANNC_DRY_RUN_NP",
    "RANNC_TRACE_EVENTS": "use RANNC_TRACE=1",
    "RANNC_EVENT_TRACE_FILE": "use RANNC_TRACE=1 and call model.write_trace(path) on every rank",
    "RANNC_PROFILING": "use RANNC_TRACE=1 for per-rank runtime events",
    "RANNC_SAVE_PROFILES": "use RANNC_PROFILE_CACHE_DIR",
    "RANNC_LOAD_PROFILES": "use RANNC_PROFILE_CACHE_DIR",
    "RANNC_PROFILE_DB": "use RANNC_PROFILE_CACHE_DIR",
    "RANNC_DUMP_GRAPH": "use model.plan.to_onnx(path)",
    "RANNC_SAVE_GRAPHS": "use model.plan.to_onnx(path)",
    "RANNC_CHECKPOINTING_NO_LAST": "use RANNC_CHECKPOINTING=stage_aware",
    "RANNC_RUN_WATCHDOG": "rannc's watchdog always runs; RANNC_TIMEOUT_S sets its time-out",
}


def _f(default: Any = None, *, factory: Any = None, lo: float | None = None,
       hi: float | None = None, open_lo: bool = False, open_hi: bool = False,
       choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] = (),
       aliases: Mapping[Any, Any] | None = None) -> Any:
    """A field with its allowed range (lo <= value <= hi; open_*: strict) or choices (a tuple,
    or a function giving them when a value is checked); `aliases` maps other accepted values
    (True, "1") to the choice they stand for."""
    meta = {"lo": lo, "hi": hi, "open_lo": open_lo, "open_hi": open_hi, "choices": choices,
            "aliases": dict(aliases or {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True, slots=True)
class Config:
    """Every rannc setting; each is also read from the environment variable RANNC_<FIELD>
    (upper case; JSON values: `RANNC_REPLICAS=[2,1]`, `RANNC_TIMEOUT_S=60`)."""

    partition_num: int | None = _f(None, lo=1)
    """Force the number of pipeline stages, >= 1 (None: the planner chooses)."""
    replicas: list[int] | None = _f(None, lo=1)
    """Force each stage's replica count, each >= 1, e.g. [2, 1]; the counts sum to the ranks of
    one pipeline, which must divide the ranks running."""
    microbatches: int | None = _f(None, lo=1)
    """Force the number of microbatches per iteration, >= 1 (None: the planner chooses)."""
    min_pipeline: int = _f(1, lo=1)
    """Smallest microbatch count the planner considers (>= 1)."""
    max_pipeline: int = _f(32, lo=1)
    """Largest microbatch count the planner considers (>= min_pipeline). 32 by default: the
    cost model prices a microbatch's kernels (launch overhead included) but not the runtime's
    own work per action (0.2 to 1.5 ms of Python per forward or backward action on the CPU
    ranks measured, its bookkeeping and the stage graph's per-operator calls: BENCHMARKS.md),
    which grows with the count. Large LLM batches gain up to a few % from 64 (BENCHMARKS.md,
    "max_pipeline 64"): raise it there."""
    blocks: int = _f(32, lo=1)
    """k: how many blocks the planner groups the model's atomic components into before it
    splits the blocks into stages (planning time grows with k^2). The chosen plans' stage
    boundaries are then refined below block level, so k bounds the planning time more than the
    plan's quality (`extra={"boundary_refinement": False}` keeps whole blocks). When no plan
    fits in k blocks, the planner tries 2k and then 4k before saying so."""
    mem_limit_gb: float | None = _f(None, lo=0, open_lo=True)
    """Per-device memory to plan for in GB, > 0 (None: the device's own)."""
    mem_margin: float = _f(0.1, lo=0, hi=1, open_hi=True)
    """Fraction of device memory kept free, in [0, 1)."""
    host_malloc: str = _f("auto", choices=("auto", "reuse", "release", "keep"))
    """How glibc's allocator treats freed tensor memory where ranks train on the CPU (whose
    memory the planner budgets as the device's): "reuse" raises its mmap and trim thresholds to
    1 GiB, so freed blocks stay in the heap and the next microbatch's tensors reuse them
    without page faults (the fastest steps; the resident memory stays at its peak, up to 1.6x
    the forecast); "release" fixes both at 128 KiB, so every tensor from that size up is
    mapped on its own and returned when freed, and a rank's resident peak follows its live
    tensors, which is what the planner forecasts, at the cost of a fresh zero-filled page per
    allocation (slower steps: BENCHMARKS.md); "keep" leaves glibc's defaults, which do some of
    each; "auto": "release" on a CPU rank whose stage's forecast times 1.75 exceeds the memory
    it may use (mem_limit_gb, else the device's, less mem_margin), else "reuse". Process-wide
    (the user's own allocations follow it too), set at deployment and logged once at INFO when
    it acts; a CUDA device or a C library other than glibc is left alone (rannc.hostmem)."""
    opt_param_factor: float | None = _f(None, lo=0)
    """Optimizer state per parameter element, >= 0 (None: read from the optimizer, Adam = 2)."""
    schedule: str = _f("auto", choices=_schedules)
    """Pipeline schedule: auto (the planner picks by simulated time within memory), or one of
    rannc.schedule.SCHEDULES: gpipe (fill-drain), 1f1b, scp (Merak's shifted critical path),
    zero_bubble (ZB-H1: each backward split into an input-gradient and a weight-gradient pass,
    the latter deferred into the pipeline's idle time), zero_bubble_lag1 (the same with each
    weight pass deferred by at most one microbatch: less memory on the later stages),
    zero_bubble_lag0 (by none: 1F1B's memory, input gradients sent before the weight pass),
    interleaved_1f1b (two stages per rank: s and s + partition_num / 2 on the same ranks,
    replicas given per rank of a pipeline), or zero_bubble_v (ZB-V: two stages per rank in a V,
    s and partition_num - 1 - s on the same ranks, each backward split as under zero_bubble;
    replicas given per rank of a pipeline)."""
    checkpointing: str = _f("auto", choices=_CHECKPOINTING)
    """Recomputation (activation checkpointing) in backward: "auto" (the planner chooses, per
    stage, the fraction of the stage to recompute that fits its memory), "on" (every stage
    recomputes all of its forward), "off" (never), "stage_aware" (as auto; the name of the
    original RaNNC's option), "selective" (every stage recomputes selectively, as
    selective_recompute describes, and nothing else: torchtitan's selective activation
    checkpointing; not with compile=True)."""
    selective_recompute: bool = _f(True)
    """Under checkpointing "auto": let the planner also choose, per stage, selective
    recomputation, which keeps a recipe instead of a saved activation made by a cheap op (an
    activation function, a norm, an elementwise product) whose inputs are kept anyway, and
    rebuilds it when backward reads it: on a Llama layer about 45 % of the saved bytes for 3 %
    of its forward (`rannc.profile.saved.recomputable`). Bit-exact (the same ops on the same
    inputs; no random ops). Not with compile=True, whose compiler chooses what it saves."""
    profiler: str = _f("auto", choices=_PROFILERS)
    """Where the planner's costs come from: "estimate" (a roofline model over the graph's
    shapes and the device's figures; no device needed), "measure" (blocks run on this rank's
    device, cached in `profile_cache_dir`), or "auto" (measure when the model's parameters are
    on a CUDA device, else estimate)."""
    save_deployment: bool = _f(False)
    """Write the plan to `deployment_file` after planning."""
    load_deployment: bool = _f(False)
    """Read the plan from `deployment_file` instead of planning (rank 0 reads it and sends it to
    every rank, so the file need only exist where rank 0 runs). It is checked against the
    model and the ranks running before anything is deployed."""
    deployment_file: str = _f("rannc_deployment.json")
    """Where plans are saved and loaded."""
    profile_cache_dir: str | None = _f(None)
    """Directory for cached profiles (None: no disk cache)."""
    cluster_file: str | None = _f(None)
    """A JSON file describing the devices by hand (rannc.Cluster.load), one per rank, used
    instead of each rank measuring its own device."""
    dry_run_np: int | None = _f(None, lo=1)
    """rannc.plan() without `cluster=`: plan for this many devices like this machine's, on
    one node (None: one), >= 1."""
    timeout_s: float = _f(300.0, lo=0, open_lo=True)
    """Seconds, > 0 and finite, before a collective that does not complete (a rank that does
    not arrive) is reported as a failure. Raise it when a rank may legitimately spend longer
    between calls (slow data loading, evaluation on one rank)."""
    seed: int | None = _f(None, lo=0)
    """When set (>= 0): at deployment (the first call), after capture and planning, every rank
    calls torch.manual_seed(seed), so dropout and other random ops draw the same numbers on
    every rank from the first step on, whatever planning consumed. None: torch's RNG is left
    as the script set it."""
    max_captures: int = _f(8, lo=1)
    """How many captured input signatures (e.g. sequence lengths) are kept, >= 1; the least
    recently used one is dropped beyond it (its next call captures again). Pad inputs to a few
    bucket lengths when they vary."""
    zero_stage: int | str = _f("auto", choices=(0, 1, "auto"), aliases={"0": 0, "1": 1})
    """ZeRO stage of the optimizer state: 0 (every replica of a stage keeps the state of all
    the stage's parameters, as DDP), 1 (ZeRO-1: each parameter's state lives on one replica,
    which steps it and sends the new values to the others after the step; Adam's 8 bytes per
    parameter divide by the replicas), or "auto" (the planner plans without ZeRO-1 and, where
    the plan has replicas or nothing fits, with it, and keeps the faster predicted plan: the
    memory it frees can spare recomputation, the all-gather after the step costs time).
    Gradients, clipping and `zero_grad()` are unchanged: every replica's `.grad` holds the full
    reduced gradient."""
    bucket_mb: float = _f(25.0, lo=0, open_lo=True)
    """Size in MB (2^20 bytes), > 0, of the buckets gradients are all-reduced in over the ranks
    holding them (rannc.pipeline.grads): each bucket starts as soon as its gradients are final
    in the last microbatch's backward, overlapping the rest. The reduction holds at most one
    bucket beyond the gradients, which the planner's memory model counts on every stage whose
    gradients are reduced. Smaller: more, shorter collectives that start earlier."""
    grad_accumulation: bool | str = _f("auto", choices=("auto", "on", "off"), aliases=_SWITCH)
    """Whether the training loop accumulates gradients over calls under `no_sync()`, which the
    memory model then counts: under the schedules that run backward inside forward(), a
    micro-step's own gradients exist beside the accumulated ones while its forward runs (the
    loss gradient that scales them comes with backward()), one more copy of each stage's
    gradients. "auto": as the first call, planned for accumulation when it is made under
    `no_sync()` (an accumulation's first micro-step; `rannc.plan()`, without a call, plans
    without); "on" (True) or "off" (False) either way. Read back as "auto", "on" or "off"."""
    trace: bool = _f(False)
    """Record each rank's pipeline actions with their times, for `RaNNCModule.write_trace`
    (a Perfetto trace and a timeline PNG beside the simulator's prediction)."""
    extra: dict[str, Any] = _f(factory=dict)
    """Options for experimental planner features, a dict; e.g. `{"boundary_refinement":
    False}` keeps stage boundaries on whole blocks. Unknown keys are ignored."""
    compile: bool = _f(False)
    """torch.compile each stage's module (the graphs rannc runs), not the RaNNCModule itself."""
    batchnorm: str = _f("local", choices=("local", "sync"))
    """BatchNorm in training: "local" (each microbatch on each stage replica normalises over
    its own rows, as DDP without SyncBatchNorm; warned about when the plan has several) or
    "sync" (exact on the global batch: one microbatch for the whole plan, statistics summed
    over a stage's replicas in forward and backward). Running statistics follow the global
    batch, updated once per call, in both."""

    progress: bool | str = _f("auto", choices=("auto", "on", "off"), aliases=_SWITCH)
    """Progress bars on stderr, on rank 0, for the first call's capture, atomic components,
    profiling and stage DP search (minutes on a large model): "auto" when stderr is a terminal
    (never in logs or CI output), "on" (or True, RANNC_PROGRESS=1) always, "off" (False,
    RANNC_PROGRESS=0) never. Read back as "auto", "on" or "off"."""

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, check_field(f.name, getattr(self, f.name), f"Config.{f.name}"))
        if self.min_pipeline > self.max_pipeline:
            raise ConfigError(
                f"Config.min_pipeline ({self.min_pipeline}) exceeds max_pipeline "
                f"({self.max_pipeline}). Fix: raise max_pipeline or lower min_pipeline")
        if self.checkpointing == "selective" and self.compile:
            raise ConfigError(
                "Config.checkpointing='selective' cannot be combined with compile=True: the "
                "compiler chooses what each stage saves. Fix: drop compile=True, or use "
                "checkpointing='auto'")

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
                values[f.name] = check_field(f.name, _parse_env(f.name, key, environ[key]), key)
        if config is not None:
            default = cls()
            for f in fields(cls):
                if getattr(config, f.name) != getattr(default, f.name):
                    values[f.name] = getattr(config, f.name)
        values.update(options)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_docs() -> str:
    """The fields' docstrings, read from this file, for help(rannc.Config) (a slots dataclass
    has no per-attribute docs of its own)."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(Config))
    except (OSError, TypeError):  # no source (frozen install): the class docstring alone
        return ""
    body = tree.body[0].body  # type: ignore[attr-defined]
    hints = typing.get_type_hints(Config)
    lines = ["", "", "Fields:"]
    for node, doc in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            name = node.target.id
            f = Config.__dataclass_fields__[name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            lines.append(f"    {name} ({_type_name(hints[name])}, default {default!r}; "
                         f"RANNC_{name.upper()}):")
            lines += [f"        {line.strip()}" for line in str(doc.value.value).splitlines()]
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def check_field(name: str, value: Any, where: str) -> Any:
    """`value` for field `name` as its declared type (an int is taken for a float), or a
    ConfigError naming `where` (Config.x or RANNC_X), the value and the fix."""
    f = Config.__dataclass_fields__[name]
    tp = _hints()[name]
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp) if optional else tp
    if value is None and optional:
        return None
    meta = f.metadata
    origin = typing.get_origin(base) or base
    given = value
    aliases = meta.get("aliases") or {}
    key = value.lower() if isinstance(value, str) else value
    if isinstance(value, bool | str) and key in aliases:  # (an int alias key would match True)
        value = aliases[key]
    ok = True
    if origin is bool:
        ok = isinstance(value, bool)
    elif origin is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif origin is str:
        ok = isinstance(value, str)
    elif origin is list:
        ok = isinstance(value, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value) and len(value) > 0
        value = list(value) if ok else value
    elif origin is dict:
        ok = isinstance(value, dict)
    if ok and _choices(meta) and (value not in _choices(meta) or (
            isinstance(value, bool) and not any(isinstance(c, bool) for c in _choices(meta)))):
        ok = False  # (True == 1: a bool is not a choice of 0 and 1)
    if ok and origin in (int, float, list):
        for x in value if origin is list else [value]:
            lo, hi = meta.get("lo"), meta.get("hi")
            if lo is not None and (x < lo or (meta["open_lo"] and x == lo)):
                ok = False
            if hi is not None and (x > hi or (meta["open_hi"] and x == hi)):
                ok = False
    if not ok:
        raise ConfigError(f"{where}={given!r} is not valid: {name} must be "
                          f"{_expected(base, meta, optional)}. Fix: {_fix(name, base, meta, where)}")
    return value


def _choices(meta: Mapping[str, Any]) -> tuple[str, ...]:
    c = meta.get("choices") or ()
    return tuple(c() if callable(c) else c)


def _expected(base: Any, meta: Mapping[str, Any], optional: bool) -> str:
    origin = typing.get_origin(base) or base
    if _choices(meta):
        text = "one of " + ", ".join(repr(c) for c in _choices(meta))
        if any(isinstance(k, bool) for k in meta.get("aliases") or {}):
            text += " (or True, False)"
    else:
        text = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string",
                list: "a non-empty list of integers", dict: "a dict"}.get(origin, str(base))
        lo, hi = meta.get("lo"), meta.get("hi")
        each = " each" if origin is list else ""
        if lo is not None and hi is not None:
            left, right = "(" if meta["open_lo"] else "[", ")" if meta["open_hi"] else "]"
            text += f"{each} in {left}{lo:g}, {hi:g}{right}"
        elif lo is not None:
            text += f"{each} {'>' if meta['open_lo'] else '>='} {lo:g}"
    return text + (", or None (unset)" if optional else "")


_EXAMPLES = {bool: "1", int: "2", float: "60", str: "NAME", list: "[2,1]", dict: '{"key": 1}'}


def _fix(name: str, base: Any, meta: Mapping[str, Any], where: str) -> str:
    origin = typing.get_origin(base) or base
    example = _choices(meta)[0] if _choices(meta) else _EXAMPLES.get(origin, "...")
    if name == "timeout_s":
        example = "600"
    if where.startswith("RANNC_"):
        return (f"set {where} to such a value (e.g. {where}={example}; numbers and lists are "
                f"read as JSON), or unset it")
    shown = repr(example) if origin is str or meta.get("choices") \
        else example.replace("1", "True") if origin is bool else example.replace(",", ", ")
    return f"pass {name}={shown} or another such value (or RANNC_{name.upper()}={example})"


_HINTS: dict[str, Any] = {}


def _hints() -> dict[str, Any]:
    if not _HINTS:  # the annotations are strings (postponed evaluation): resolve them once
        _HINTS.update(typing.get_type_hints(Config))
    return _HINTS


def _warn_unknown_env(environ: Mapping[str, str], names: set[str]) -> None:
    """A mistyped RANNC_* variable would otherwise be ignored without a word (the run then
    plans without the setting the user thinks is on)."""
    known = {f"RANNC_{n.upper()}" for n in names} | set(LAUNCH_ENV)
    for key in sorted(k for k in environ if k.startswith("RANNC_") and k not in known):
        if key in RANNC_ORIGINAL_ENV:
            hint = f"RaNNC read it, rannc does not; {RANNC_ORIGINAL_ENV[key]}. "
        else:
            m = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {m[0]}? " if m else ""
        warnings.warn(f"rannc ignores the environment variable {key}: {hint}rannc reads "
                      f"{', '.join(sorted(known))}", UserWarning, stacklevel=3)


def _parse_env(name: str, key: str, text: str) -> Any:
    """RANNC_* values are JSON (numbers, lists, true/false, null) or, for a string field, the
    text itself; a value of the wrong kind is left for check_field to name."""
    tp = _hints()[name]
    if str in typing.get_args(tp) or tp is str:
        return None if text.lower() in ("none", "null") and tp is not str else text
    if tp is bool:
        if text.lower() not in _YES + _NO:
            raise ConfigError(f"{key}={text!r} is not valid: {name} must be a boolean. Fix: set "
                              f"{key} to 1/0/true/false, or unset it")
        return text.lower() in _YES
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


Config.__doc__ = (Config.__doc__ or "") + _field_docs()
