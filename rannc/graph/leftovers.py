"""What torch keeps of a capture, process-wide, after rannc drops it; given back with it.

rannc keeps `max_captures` captures and drops the least recently used, so a model called with
a new input shape at every step (an unpadded sequence length) is captured at every step. Two
things torch keeps of each capture outlived it, so the process grew at every step, without
bound (`tests/test_bad_input.py`):

1. **Generated sources.** Each `GraphModule` compiles its code from a generated source that
   torch.fx stores in a process-wide cache (`torch.fx.graph_module._loader.eval_cache`, with a
   `linecache` entry, so that tracebacks show the lines) and never removes. A capture makes
   several (torch.export's passes, the stage modules, their recompilations): about 0.15 MB of
   source per capture of a small BERT, megabytes for a large model. A `Mark` taken before the
   capture gives the keys the cache gained since; a key of a module still alive would only
   lose its traceback lines.
2. **The capture's ShapeEnv**, its FakeTensorMode, fake tensors and dispatch cache (about
   1 MiB and 4,300 objects a capture of a 2-layer BERT). torch.export records every input's
   fake tensor in `ShapeEnv.tracked_fakes` (for the guards it makes at the end of the export).
   A fake tensor's symbolic sizes live in C++ (its TensorImpl's SymInts, each holding a Python
   SymNode that points back to the ShapeEnv), so the cycle ShapeEnv -> tracked fake -> fake
   tensor -> (C++) -> SymNode -> ShapeEnv is one Python's garbage collector cannot see, and
   is never freed. Besides, ShapeEnv's memoised methods (`functools.lru_cache` on the class,
   most of them unbounded) keep every ShapeEnv they were called on in their keys. Giving back
   empties the dropped capture's tracked fakes (its guards were made when it was captured)
   and clears those method caches (the next trace recomputes what it asks them).

Where torch has no such cache or attribute (another version), that part is skipped.
"""

from __future__ import annotations

import linecache
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import fx


def _cache() -> dict[str, Any] | None:
    try:
        from torch.fx import graph_module
    except ImportError:  # pragma: no cover
        return None
    loader = getattr(graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    return cache if isinstance(cache, dict) else None


@dataclass
class Leftovers:
    """What torch keeps of one capture: its generated sources' keys, and its ShapeEnvs (weakly:
    this record must not be what keeps them)."""

    sources: list[str] = field(default_factory=list)
    shape_envs: list[weakref.ref[Any]] = field(default_factory=list)


class Mark:
    """The sources torch.fx has cached so far."""

    def __init__(self) -> None:
        cache = _cache()
        self._before = set(cache) if cache is not None else set()

    def new(self, gm: fx.GraphModule) -> Leftovers:
        """What the capture `gm` (and everything built since the mark) left with torch."""
        cache = _cache()
        sources = [] if cache is None else [k for k in cache if k not in self._before]
        return Leftovers(sources, [weakref.ref(env) for env in shape_envs(gm)])


def shape_envs(gm: fx.GraphModule) -> list[Any]:
    """The ShapeEnvs of the fake values recorded on `gm`'s nodes (one for a torch.export)."""
    found: dict[int, Any] = {}
    for node in gm.graph.nodes:
        env = _env_of(node.meta.get("val"))
        if env is not None:
            found.setdefault(id(env), env)
    return list(found.values())


def _env_of(val: Any) -> Any:
    """The ShapeEnv of a node's recorded value: a FakeTensor's mode's, or a SymInt's; else None."""
    return getattr(getattr(val, "fake_mode", None), "shape_env", None) \
        or getattr(getattr(val, "node", None), "shape_env", None)


def forget(leftovers: Leftovers | None) -> None:
    """Give back what a dropped capture left with torch (see the module docstring)."""
    if leftovers is None:
        return
    cache = _cache()
    for k in leftovers.sources:
        if cache is not None:
            cache.pop(k, None)
        linecache.cache.pop(k, None)
    envs = [env for ref in leftovers.shape_envs if (env := ref()) is not None]
    for env in envs:
        tracked = getattr(env, "tracked_fakes", None)
        if isinstance(tracked, list):
            tracked.clear()
    if envs:
        _clear_method_caches(type(envs[0]))
        _forget_last_export(envs)


def _forget_last_export(envs: list[Any]) -> None:
    """torch.export's map from its last trace's fake tensors to the trace's nodes (emptied when
    the next export starts, read while one runs) holds that trace's ShapeEnv: the last capture
    of a wrapped model that is gone. Emptied only when it is one of `envs`: this can run from a
    finalizer in the middle of another model's export, whose map must stay."""
    try:
        from torch.fx.experimental import proxy_tensor
    except ImportError:  # pragma: no cover
        return
    last = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if not isinstance(last, dict) or not last:
        return
    for node in last.values():
        env = _env_of(getattr(node, "meta", {}).get("val"))
        if env is not None:
            if any(env is e for e in envs):
                last.clear()
            return


def forget_all(leftovers: Iterable[Leftovers]) -> None:
    for x in leftovers:
        forget(x)


def _clear_method_caches(cls: type) -> None:
    for klass in cls.__mro__:
        for attr in vars(klass).values():
            clear = getattr(attr, "cache_clear", None)
            if callable(clear):
                clear()


__all__ = ["Leftovers", "Mark", "forget", "forget_all", "shape_envs"]
