"""The generated source torch.fx keeps for every graph module, given back with the capture.

Why: each `GraphModule` compiles its code from a generated source that torch.fx stores in a
process-wide cache (`torch.fx.graph_module._loader.eval_cache`, with a `linecache` entry, so
that tracebacks show the lines) and never removes. A capture makes several (torch.export's
passes, the stage modules, their recompilations): about 0.15 MB of source per capture of a
small BERT, megabytes for a large model. rannc keeps `max_captures` captures and drops the
least recently used, so a model called with a new input shape at every step (an unpadded
sequence length) grew the cache at every step, without bound (`tests/test_bad_input.py`).

How: a `Mark` taken before a capture and its deployment are built gives the keys the cache
gained since (`Mark.new`); `forget` removes them when that capture is dropped, or when the
wrapped model is gone. A key of a module still alive would only lose its traceback lines.
Where torch.fx has no such cache (another version), nothing is done.
"""

from __future__ import annotations

import linecache
from collections.abc import Iterable
from typing import Any


def _cache() -> dict[str, Any] | None:
    try:
        from torch.fx import graph_module
    except ImportError:  # pragma: no cover
        return None
    loader = getattr(graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    return cache if isinstance(cache, dict) else None


class Mark:
    """The sources torch.fx has cached so far."""

    def __init__(self) -> None:
        cache = _cache()
        self._before = set(cache) if cache is not None else set()

    def new(self) -> list[str]:
        """The keys of the sources cached since the mark."""
        cache = _cache()
        return [] if cache is None else [k for k in cache if k not in self._before]


def forget(keys: Iterable[str]) -> None:
    """Remove these sources from torch.fx's cache and from `linecache`."""
    cache = _cache()
    for k in keys:
        if cache is not None:
            cache.pop(k, None)
        linecache.cache.pop(k, None)


__all__ = ["Mark", "forget"]
