"""The *measure* cost oracle: run every block's forward and backward on this rank's device.

What is measured, per block j (a group of atomic components, run as the stage module
`build_stage_module` makes, constant tasks included) and per-replica batch size b:

- **Inputs.** The full captured graph runs once on the example inputs (`torch.fx.Interpreter`
  over `cap.gm`, under `no_grad`), keeping a copy of every value some block reads from another
  block. A block's input at batch b is that recording cut or tiled along the value's batch dim
  to `b * batch_scale` rows (whole samples, so per-sample structure such as `(B*16, V)` views
  stays intact); token ids and masks stay valid because they are real values. Symbolic sizes
  are evaluated at b. Parameters, buffers and lifted constants are the model's own tensors
  (copied to the device when they live elsewhere). Floating activations that autograd would
  track in a real run (statically: a float value computed from a parameter that requires grad
  or from such a value) are leaves with `requires_grad`, so backward runs through the block.
- **Time.** Forward, then backward with `torch.autograd.grad(outputs, grad_outputs=ones,
  inputs=[tracked inputs, parameters])`, which computes every gradient a real step computes
  but never touches a parameter's `.grad`. CUDA events on GPU, `perf_counter` on CPU, around
  every run's forward and backward (fresh input copies are made outside the timed spans).
  After `warmup` runs, runs go in rounds of `inner` (chosen so a round lasts about
  `min_sample_s`, so tiny blocks get many runs per stability check) until the median of
  forward+backward over all runs so far moves by less than `tolerance` (5 %) from one round
  to the next, with at least `min_reps` rounds, or `max_reps` rounds, or `max_seconds` per
  entry. The entry is the median forward and the median backward over all runs: a stall of a
  shared machine during a few runs does not move it.
- **Memory.** `kept`: bytes kept for backward by one microbatch. On CPU, the distinct storages
  autograd saves (`torch.autograd.graph.saved_tensors_hooks`) minus those of the block's inputs,
  parameters and buffers (the stage tables count inputs separately). On GPU, the allocator:
  `memory_allocated` after forward minus before. `work` (transient bytes beyond those): on
  GPU the allocator's peak above `before + kept` (minus the parameter gradients, which the
  memory model counts as static); on CPU, where there is no allocator peak to read, the
  estimate's largest single-task working set.
- **Out of memory.** A CUDA OOM (or the CPU allocator failing) marks the entry infeasible
  (`inf` time and memory), and the block's larger batch sizes with it, instead of failing.
- **No side effects.** The torch (and CUDA) RNG state is restored afterwards (planning runs
  inside the user's first forward call), every buffer the blocks may mutate (BatchNorm running
  statistics: `aten.batch_norm` does not declare its writes) is cloned before and copied back
  after, and `.grad` is never written.

`component_time(b)` (what coarsening sees for thousands of atomic components) is not measured
per component: it is the estimate's per-component time scaled by one calibration factor,
`measured / estimated` forward+backward time of the whole model at batch b. The whole model is
measured as one block, or, if that does not fit the device, as 2, 4, ... contiguous chunks of
components (contiguous runs of a topological order are always a valid cut). So coarsening
sees this device's real speed, and the relative cost of components comes from the roofline.

Entries are kept in memory for the oracle's lifetime (a block shared by two calls, such as the
whole-model block of calibration, is measured once), and measured ones are cached on disk
(`rannc.profile.cache`) when a directory is given, keyed by graph fingerprint, device identity,
block membership and batch size. A block that fails to run
for any reason other than memory falls back to the estimate (scaled by the calibration factor
when one is known) with a warning; `fallbacks` lists them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from rannc.atomic.components import AtomicPartition
from rannc.errors import ConfigError
from rannc.graph.capture import CapturedModel, running_as
from rannc.graph.extract import StageGraph, build_stage_module, split_graph
from rannc.graph.task_graph import Value, ValueKind, eval_dim
from rannc.profile.cache import Entry, ProfileCache, block_key
from rannc.profile.device import DeviceSpec
from rannc.profile.estimate import FLOAT_DTYPES, BlockProfile, GraphCosts
from rannc.profile.oracle import BlockOracle
from rannc.progress import Progress, progress_for

log = logging.getLogger(__name__)

METHOD_VERSION = "measure-v1"  # bump when what an entry means changes (invalidates caches)

# Ops whose floating output autograd never tracks.
_NO_GRAD_OPS = {
    "aten.detach.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.empty_like.default", "aten.full_like.default", "aten.rand_like.default",
    "aten.randn_like.default", "aten.bernoulli.default", "aten.new_zeros.default",
    "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
}

_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


def device_identity(device: torch.device) -> str:
    """What a cached measurement depends on: the device model, the torch build, threads."""
    ver = f"torch{torch.__version__}|{METHOD_VERSION}"
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        return f"cuda|{p.name}|{p.total_memory}|cc{p.major}.{p.minor}|{ver}"
    return f"{device.type}|{_cpu_model()}|threads{torch.get_num_threads()}|{ver}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """When a measurement is stable enough (see the module docstring)."""

    warmup: int = 1
    min_reps: int = 3  # rounds of runs
    max_reps: int = 15
    tolerance: float = 0.05
    max_seconds: float = 2.0  # per (block, batch) entry, warm-up excluded
    min_sample_s: float = 2e-3  # a round of runs lasts at least about this long


class MeasureOracle(BlockOracle):
    """Costs measured by running blocks on `device` (see the module docstring).

    cap, atomic: the captured model and its atomic partition; model: the user's module, with
    parameters on a real device (not `meta`); leaves: the example call's flat input leaves
    (`flatten_inputs`); device: where to measure; costs and spec: the roofline estimate used
    for per-component times (with calibration), CPU working memory and fallbacks; cache_dir:
    directory of the on-disk cache (None: no cache); progress: where to show a bar per
    profiling pass, one step per (block, batch size) run (`rannc.progress`; True: on stderr,
    False or None: none).
    """

    def __init__(self, cap: CapturedModel, atomic: AtomicPartition, model: nn.Module,
                 leaves: Sequence[Any], device: torch.device | str, costs: GraphCosts,
                 spec: DeviceSpec, *, cache_dir: str | None = None,
                 progress: Progress | bool | None = None,
                 settings: MeasureSettings | None = None) -> None:
        self.cap = cap
        self.graph = cap.graph
        self.atomic = atomic
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.costs = costs
        self.spec = spec
        self.settings = settings or MeasureSettings()
        self.progress = progress if isinstance(progress, Progress) else \
            progress_for(bool(progress), 0)
        self.env = cap.bind(model, leaves)
        for name, t in self.env.items():
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                raise ConfigError(
                    f"the measure profiler runs the model, but {name} is on the meta device; "
                    "materialise the model or use profiler='estimate'")
        self.leaves = list(leaves)
        self.fingerprint = self.graph.fingerprint()
        self.device_key = device_identity(self.device)
        self.cache = ProfileCache(cache_dir, self.fingerprint, self.device_key) if cache_dir else None
        self.fallbacks: list[tuple[int, int, str]] = []  # (block, batch, error) run by estimate
        self.factors: dict[int, float] = {}  # calibration factor per batch size
        self.measured_entries = 0  # (block, batch) entries actually run (not from a cache)
        self.last_runs = 0  # timed runs of the last measured entry
        self._recorded: dict[str, torch.Tensor] = {}
        self._memo: dict[tuple[str, int], Entry] = {}  # this run's entries, OOM included
        self._tracked = self._tracked_values()
        self._mutable = self._mutable_tensors()
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers while profiling

    # -- the oracle interface ------------------------------------------------------------------
    def component_time(self, batch: int) -> np.ndarray:
        """The estimate's per-component forward+backward seconds times `calibration(batch)`."""
        return self.costs.component_time(self.spec, batch) * self.calibration(batch)

    def calibration(self, batch: int) -> float:
        """measured / estimated forward+backward seconds of the whole model at `batch` (1.0 when
        no chunking of the model fits the device)."""
        if batch in self.factors:
            return self.factors[batch]
        est = float(self.costs.component_time(self.spec, batch).sum())
        n_comp = len(self.atomic.components)
        factor = 1.0
        chunks = 1
        while chunks <= n_comp:
            block_of = _chunks(self.costs.component_time(self.spec, batch), chunks)
            prof = self._profile(block_of, [batch], what="calibrating")
            total = float((prof.fwd + prof.bwd).sum())
            if math.isfinite(total):
                factor = total / est if est > 0 and total > 0 else 1.0
                break
            chunks *= 2
        else:
            log.warning("rannc: the model does not fit the device even in %d chunks at batch %d; "
                        "component times are the uncalibrated estimate", n_comp, batch)
        self.factors[batch] = factor
        log.info("rannc: measured/estimated time at batch %d: %.3g", batch, factor)
        return factor

    def block_profile(self, block_of: Sequence[int], batch_sizes: Sequence[int]) -> BlockProfile:
        return self._profile(block_of, batch_sizes)

    # -- profiling -----------------------------------------------------------------------------
    def _profile(self, block_of: Sequence[int], batch_sizes: Sequence[int],
                 what: str = "profiling") -> BlockProfile:
        batch_sizes = tuple(int(b) for b in batch_sizes)
        est = self.costs.block_profile(self.spec, block_of, batch_sizes)
        nb = est.fwd.shape[0]
        groups: list[list[int]] = [[] for _ in range(nb)]
        for c, j in enumerate(block_of):
            groups[j].append(c)
        keys = [block_key(g) for g in groups]
        out = {n: np.zeros((nb, len(batch_sizes))) for n in ("fwd", "bwd", "kept", "work")}
        todo: list[tuple[int, int]] = []
        for j in range(nb):
            for i, b in enumerate(batch_sizes):
                hit = self._memo.get((keys[j], b))
                if hit is None and self.cache is not None:
                    hit = self.cache.get(keys[j], b)
                if hit is None:
                    todo.append((j, i))
                else:
                    for n, x in zip(("fwd", "bwd", "kept", "work"), hit, strict=True):
                        out[n][j, i] = x
        if todo:
            self._measure_all(groups, keys, batch_sizes, todo, out, est, what)
        # The weight-gradient share of each measured backward: the estimate's share (timing
        # dW apart from dX would need each block's backward run twice more).
        share = np.divide(est.wgrad, est.bwd, out=np.zeros_like(est.bwd),
                          where=est.bwd > 0) if est.wgrad is not None else np.zeros_like(est.bwd)
        wgrad = np.multiply(out["bwd"], share, out=np.zeros_like(share), where=share > 0)
        if est.kept_sel is None or est.selective is None:
            return BlockProfile(batch_sizes, out["fwd"], out["bwd"], out["kept"], out["work"], wgrad,
                                stash=est.stash, bonly=_released(est, out["kept"]))
        # selective recomputation likewise: the estimate's shares of the kept bytes it drops and
        # of the forward it runs again, applied to the measured ones
        kept_share = np.divide(est.kept_sel, est.kept, out=np.ones_like(est.kept), where=est.kept > 0)
        sel_share = np.divide(est.selective, est.fwd, out=np.zeros_like(est.fwd), where=est.fwd > 0)
        # (the gradients B keeps for W are sizes and dtypes: the estimate's, not measured)
        return BlockProfile(batch_sizes, out["fwd"], out["bwd"], out["kept"], out["work"], wgrad,
                            out["kept"] * kept_share, out["fwd"] * sel_share, stash=est.stash,
                            bonly=_released(est, out["kept"]))

    def _measure_all(self, groups: list[list[int]], keys: list[str], batch_sizes: tuple[int, ...],
                     todo: list[tuple[int, int]], out: dict[str, np.ndarray], est: BlockProfile,
                     what: str) -> None:
        stages = split_graph(self.graph, self.atomic, groups)
        need = {v for j, _ in todo for v in stages[j].inputs if v not in self.env}
        # (under the autocast the graph was captured under, whoever calls: its ops are cast as
        # they run, so outside it a bf16 graph would be timed in float32)
        with self._no_side_effects(), running_as(self.cap.autocast), \
                self.progress.phase(what, total=len(todo)) as step:
            self._record(need)
            by_block: dict[int, list[int]] = {}
            for j, i in todo:
                by_block.setdefault(j, []).append(i)
            for j, cols in by_block.items():
                mod = build_stage_module(self.cap.gm, self.graph, stages[j])
                params = self._block_tensors(stages[j])
                failed = False
                for i in sorted(cols, key=lambda i: batch_sizes[i]):
                    b = batch_sizes[i]
                    measured = False
                    if failed:  # a smaller batch ran out of memory: so does this one
                        entry: Entry = (math.inf,) * 4  # type: ignore[assignment]
                    else:
                        entry, measured = self._entry(j, b, mod, stages[j], params, est, i)
                        failed = not math.isfinite(entry[0])
                    for n, x in zip(("fwd", "bwd", "kept", "work"), entry, strict=True):
                        out[n][j, i] = x
                    self._memo[(keys[j], b)] = entry
                    if self.cache is not None and measured:
                        self.cache.put(keys[j], b, entry)
                    step(1)
                del mod, params
                self._restore_buffers()
                if self.cache is not None:
                    self.cache.flush()

    def _entry(self, j: int, b: int, mod: fx.GraphModule, stage: StageGraph,
               params: dict[str, torch.Tensor], est: BlockProfile,
               col: int) -> tuple[Entry, bool]:
        """One (block, batch) entry: measured, or infinite on OOM, or the estimate on error;
        and whether it was measured (only measurements go to the cache)."""
        try:
            self.measured_entries += 1
            fwd, bwd, kept, work = self._measure_entry(mod, stage, b, params)
            if self.device.type != "cuda":
                work = float(est.work[j, col])
            return (fwd, bwd, kept, work), True
        except Exception as e:  # an op that does not run alone, an input we built badly, ...
            if _is_oom(e):
                log.info("rannc: block %d at batch %d ran out of device memory: infeasible", j, b)
                return (math.inf, math.inf, math.inf, math.inf), False
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("rannc: measuring block %d at batch %d failed (%s); using the estimate",
                        j, b, msg)
            self.fallbacks.append((j, b, msg))
            f = self.factors.get(b, 1.0)
            return (float(est.fwd[j, col]) * f, float(est.bwd[j, col]) * f,
                    float(est.kept[j, col]), float(est.work[j, col])), False
        finally:
            self._free()

    def _measure_entry(self, mod: fx.GraphModule, stage: StageGraph, batch: int,
                       params: dict[str, torch.Tensor]) -> tuple[float, float, float, float]:
        """Run one block at one batch size until stable: (fwd s, bwd s, kept bytes, work bytes)."""
        st = self.settings
        cuda = self.device.type == "cuda"
        base = [params[v] if v in params else self._input_at(v, batch) for v in stage.inputs]
        fresh = [v not in params and isinstance(x, torch.Tensor) for v, x in zip(stage.inputs, base,
                                                                                   strict=True)]
        track = [isinstance(x, torch.Tensor) and v not in params and self._tracked.get(v, False)
                 for v, x in zip(stage.inputs, base, strict=True)]
        pleaves = [x for v, x in zip(stage.inputs, base, strict=True)
                   if v in params and isinstance(x, torch.Tensor) and x.requires_grad]
        pgrad_bytes = float(sum(_nbytes(p) for p in pleaves))

        def make_inputs() -> list[Any]:
            return [x.detach().clone().requires_grad_(t) if f else x
                    for x, f, t in zip(base, fresh, track, strict=True)]

        grads: list[torch.Tensor] | None = None

        def run(inputs: list[Any], timed: bool) -> tuple[Any, Any, Any, Any]:
            nonlocal grads
            wrt = [x for x, t in zip(inputs, track, strict=True) if t] + pleaves
            marks: list[Any] = []
            if cuda and timed:
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                marks[0].record()
            else:
                marks = [time.perf_counter()]
            with torch.enable_grad():
                outs = mod(*inputs)
            diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            if cuda and timed:
                marks[1].record()
            else:
                marks.append(time.perf_counter())
            if grads is None:
                grads = [torch.ones_like(o) for o in diff]
            if cuda and timed:
                marks[2].record()
            else:
                marks.append(time.perf_counter())
            if diff and wrt:
                torch.autograd.grad(diff, wrt, grad_outputs=grads, allow_unused=True)
            if cuda and timed:
                marks[3].record()
            else:
                marks.append(time.perf_counter())
            return marks[0], marks[1], marks[2], marks[3]

        def elapsed(m: tuple[Any, Any, Any, Any]) -> tuple[float, float]:
            if cuda and isinstance(m[0], torch.cuda.Event):
                return m[0].elapsed_time(m[1]) / 1e3, m[2].elapsed_time(m[3]) / 1e3
            return m[1] - m[0], m[3] - m[2]

        # Warm-up (the first also measures memory kept on CPU) and the memory run on GPU.
        kept = work = 0.0
        t_warm = time.perf_counter()
        for w in range(max(1, st.warmup)):
            inputs = make_inputs()
            if w == 0 and not cuda:
                kept = self._saved_bytes(functools.partial(run, inputs, False), inputs, pleaves)
            else:
                run(inputs, False)
        if cuda:
            torch.cuda.synchronize(self.device)
        one = (time.perf_counter() - t_warm) / max(1, st.warmup)
        if cuda:
            inputs = make_inputs()
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            with torch.enable_grad():
                outs = mod(*inputs)
            torch.cuda.synchronize(self.device)
            after_f = torch.cuda.memory_allocated(self.device)
            peak_f = torch.cuda.max_memory_allocated(self.device)
            diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            wrt = [x for x, t in zip(inputs, track, strict=True) if t] + pleaves
            if diff and wrt:
                g = torch.autograd.grad(diff, wrt, grad_outputs=grads, allow_unused=True)
                torch.cuda.synchronize(self.device)
                del g
            peak = torch.cuda.max_memory_allocated(self.device)
            kept = float(max(0, after_f - before))
            work = float(max(0.0, peak_f - after_f, peak - before - kept - pgrad_bytes))
            del outs, diff, wrt, inputs

        # Rounds of `inner` runs each (a round lasts about min_sample_s); every run is timed on
        # its own and the entry is the median over all runs, so a stall of the machine during
        # one run does not move it. Stop once the median moved by less than `tolerance` since
        # the previous round (with at least min_reps rounds), or at max_reps / max_seconds.
        inner = max(1, min(100, math.ceil(st.min_sample_s / max(one, 1e-9))))
        fs: list[float] = []
        bs: list[float] = []
        prev: float | None = None
        rounds = 0
        t0 = time.perf_counter()
        while True:
            marks = []
            for _ in range(inner):
                inputs = make_inputs()
                marks.append(run(inputs, True))
            if cuda:
                torch.cuda.synchronize(self.device)
            for m in marks:
                f, b = elapsed(m)
                fs.append(f)
                bs.append(b)
            rounds += 1
            med = statistics.median(f + b for f, b in zip(fs, bs, strict=True))
            if rounds >= st.min_reps and prev is not None and abs(med - prev) <= st.tolerance * prev:
                break
            if rounds >= st.max_reps or (rounds >= 2 and time.perf_counter() - t0 > st.max_seconds):
                break
            prev = med
        self.last_runs = len(fs)
        return statistics.median(fs), statistics.median(bs), kept, work

    def _saved_bytes(self, fn: Callable[[], object], inputs: Sequence[Any],
                     params: Sequence[torch.Tensor] = ()) -> float:
        """Bytes of the distinct storages autograd saves while `fn` runs, other than those of
        the block's inputs, parameters and buffers, and of the half-precision copies autocast
        makes of `params` (one per autocast region, shared by a call's microbatches: the memory
        model counts them with the parameters, `saved.autocast_copies`)."""
        exclude = {_storage_key(x) for x in inputs if isinstance(x, torch.Tensor)}
        leaves = {id(p) for p in params}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            k = _storage_key(t)
            if k not in exclude and k not in seen and not _cast_of(t, leaves):
                seen[k] = _storage_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return float(sum(seen.values()))

    # -- inputs --------------------------------------------------------------------------------
    def _record(self, names: set[str]) -> None:
        """Run the captured graph on the example inputs and keep a copy of `names`."""
        missing = names - self._recorded.keys()
        if not missing:
            return
        gm = self.cap.gm
        args = [self.env.get(n.name) for n in gm.graph.nodes if n.op == "placeholder"]
        rec = _Recorder(gm, missing)
        with torch.no_grad():
            rec.run(*args)
        lost = missing - rec.kept.keys()
        if lost:
            raise RuntimeError(f"the captured graph did not compute {sorted(lost)[:5]}")
        self._recorded.update(rec.kept)

    def _input_at(self, name: str, batch: int) -> Any:
        """Value `name` for a microbatch of `batch` samples, on the device."""
        val = self.graph.values[name]
        if not val.is_tensor:
            return _sym_at(val, batch)
        x = self.env[name] if name in self.env else self._recorded[name]
        if not isinstance(x, torch.Tensor):
            return x
        # cut on the recording's device, tile on the measuring one (an OOM there is caught)
        x = _rows(x, val, min(batch, _samples(x, val)))
        return _rows(x.to(self.device), val, batch)

    def _block_tensors(self, stage: StageGraph) -> dict[str, torch.Tensor]:
        """The block's parameters, buffers and constants on the device (the user's own tensors
        when they already live there)."""
        out: dict[str, torch.Tensor] = {}
        for v in stage.inputs:
            val = self.graph.values[v]
            if val.kind in (ValueKind.PARAM, ValueKind.BUFFER, ValueKind.CONSTANT) and v in self.env:
                t = self.env[v]
                if not isinstance(t, torch.Tensor):
                    continue
                if t.device != self.device:
                    t = t.detach().to(self.device).requires_grad_(t.requires_grad)
                out[v] = t
        return out

    def _tracked_values(self) -> dict[str, bool]:
        """Per value: autograd would track it in a real step (see the module docstring)."""
        tracked: dict[str, bool] = {}
        for name, val in self.graph.values.items():
            t = self.env.get(name)
            tracked[name] = (val.kind in (ValueKind.PARAM, ValueKind.INPUT)
                             and isinstance(t, torch.Tensor) and t.requires_grad)
        for task in self.graph.tasks:
            src = task.op not in _NO_GRAD_OPS and any(tracked.get(v, False) for v in task.inputs)
            for o in task.outputs:
                tracked[o] = src and self.graph.values[o].dtype in FLOAT_DTYPES
        return tracked

    # -- side effects ----------------------------------------------------------------------------
    def _mutable_tensors(self) -> list[torch.Tensor]:
        """The user's buffers and lifted constants a block may write in place."""
        out: dict[int, torch.Tensor] = {}
        for name, val in self.graph.values.items():
            if val.kind in (ValueKind.BUFFER, ValueKind.CONSTANT) and name in self.env:
                t = self.env[name]
                if isinstance(t, torch.Tensor):
                    out[id(t)] = t
        return list(out.values())

    @contextlib.contextmanager
    def _no_side_effects(self) -> Iterator[None]:
        """Restore the RNG streams and every buffer afterwards."""
        cpu_rng = torch.get_rng_state()
        use_cuda = self.device.type == "cuda" or torch.cuda.is_initialized()
        cuda_rng = torch.cuda.get_rng_state_all() if use_cuda else None
        self._saved = [(t, t.detach().clone()) for t in self._mutable]
        try:
            yield
        finally:
            self._restore_buffers()
            self._saved = []
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for t, saved in self._saved:
                t.copy_(saved)

    def _free(self) -> None:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


class _Recorder(fx.Interpreter):
    """An interpreter that keeps a detached copy of the named nodes' values."""

    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.kept: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.keep:
            # a copy: an in-place op later in the graph must not change what we recorded
            self.kept[n.name] = result.detach().clone() if isinstance(result, torch.Tensor) else result
        return result


# -- helpers -------------------------------------------------------------------------------------

def _rows(x: torch.Tensor, val: Value, batch: int) -> torch.Tensor:
    """`x` cut or tiled along its batch dim to `batch * batch_scale` rows."""
    d = val.batch_dim
    if d is None or x.dim() <= d:
        return x
    want = batch * val.batch_scale
    have = x.shape[d]
    if have == want:
        return x
    if have == 0:
        raise RuntimeError(f"value {val.name} was recorded with no rows")
    if want > have:
        reps = [1] * x.dim()
        reps[d] = math.ceil(want / have)
        x = x.repeat(*reps)
    return x.narrow(d, 0, want)


def _samples(x: torch.Tensor, val: Value) -> int:
    """Whole samples recorded in `x` (a huge number when it has no batch dim)."""
    d = val.batch_dim
    if d is None or x.dim() <= d:
        return sys.maxsize
    return max(1, x.shape[d] // max(1, val.batch_scale))


def _sym_at(val: Value, batch: int) -> int:
    return eval_dim(val.sym_expr or "batch", batch)


def _chunks(time_: np.ndarray, k: int) -> list[int]:
    """k contiguous runs of components (a topological order) of about equal estimated time."""
    n = len(time_)
    k = max(1, min(k, n))
    cum = np.cumsum(time_)
    total = float(cum[-1]) if n else 0.0
    if total <= 0:
        raw = (np.arange(n) * k) // max(n, 1)
    else:
        raw = np.minimum((cum - time_ / 2) / total * k, k - 1).astype(int)
    _, dense = np.unique(raw, return_inverse=True)
    return [int(x) for x in dense]


def _released(est: BlockProfile, kept: np.ndarray) -> np.ndarray | None:
    """What a split backward releases after B, per block and batch: the estimate's share of
    its kept bytes, applied to the measured ones (as selective recomputation's)."""
    if est.bonly is None:
        return None
    share = np.divide(est.bonly, est.kept, out=np.zeros_like(est.kept), where=est.kept > 0)
    return kept * share


def _is_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator failing (which raises a RuntimeError)."""
    if isinstance(e, _OOM_ERRORS):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text
                                            or "out of memory" in text.lower())


# autograd nodes of views, through which a saved transpose of a weight's cast reaches the cast
_VIEW_NODES = frozenset({"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
                         "PermuteBackward0", "ExpandBackward0", "AliasBackward0"})


def _cast_of(t: torch.Tensor, leaves: set[int]) -> bool:
    """Whether `t` is (a view of) a dtype cast of one of the leaf tensors `leaves`: what
    autocast makes of a parameter."""
    fn = t.grad_fn
    while fn is not None and fn.name() in _VIEW_NODES and fn.next_functions:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
        return False
    src = fn.next_functions[0][0]
    return id(getattr(src, "variable", None)) in leaves


def _storage_key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr()) or id(t)
    except (RuntimeError, NotImplementedError):
        return id(t)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return _nbytes(t)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


__all__ = ["MeasureOracle", "MeasureSettings", "device_identity"]
