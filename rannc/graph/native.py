"""Graph algorithms with a native (C++, `rannc._C`) implementation and a Python reference.

The native build is the one used; the Python reference in `task_graph` is what
the tests compare it against, and the fallback for a source tree in which the
extension has not been built (a log line says so once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from rannc.graph import task_graph as _ref

log = logging.getLogger(__name__)

try:
    from rannc import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only in an unbuilt tree
    _C = None
    log.info("rannc._C is not built; using the Python graph algorithms")


def has_native() -> bool:
    return _C is not None


def topological_order(n: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    if _C is not None:
        return list(_C.topological_order(n, list(edges)))
    return _ref.topological_order(n, edges)


def forward_reachable(n: int, edges: Sequence[tuple[int, int]], sources: Iterable[int]) -> list[bool]:
    if _C is not None:
        return list(_C.forward_reachable(n, list(edges), list(sources)))
    return _ref.forward_reachable(n, edges, sources)
