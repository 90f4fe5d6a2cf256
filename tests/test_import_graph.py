"""No import cycle among rannc's modules, lazy (function-level) imports included.

A cycle works today only while every edge but one stays inside a function; the next
refactor that hoists one to the top breaks `import rannc` with a half-initialised module.
Imports under `if TYPE_CHECKING:` never run and are not counted. Reads the sources (ast):
no module is imported, so this runs in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rannc

pytestmark = pytest.mark.layer("pure")

ROOT = Path(rannc.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(tree: ast.AST, mods: dict[str, Path]) -> set[str]:
    """The rannc modules `tree` imports anywhere but under TYPE_CHECKING."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.add(child.module)
                # `from rannc import dist` imports the module rannc.dist
                out.update(f"{child.module}.{a.name}" for a in child.names)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            stack.append(child)
    return {m for m in out if m in mods}


def import_graph() -> dict[str, set[str]]:
    """Module -> the rannc modules it imports. An edge to an enclosing package (rannc,
    rannc.graph) is left out: Python has already started that package before its
    submodule runs, so it closes no cycle of its own."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = _imported(ast.parse(path.read_text()), mods)
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_rannc_modules() -> None:
    graph = import_graph()
    assert "rannc.planner" in graph and "rannc.graph.capture" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_moved_names_still_import_from_their_old_modules() -> None:
    import rannc.errors as errors
    from rannc.checkpoint import CheckpointError, CheckpointMismatchError
    from rannc.health import RankFailure
    from rannc.planner import BlockOracle, EstimateOracle, PlanInfeasibleError, param_names_of
    from rannc.plans import param_names_of as pn
    from rannc.profile.oracle import BlockOracle as BO
    from rannc.schedule.actions import ScheduleError
    from rannc.schedule.trace import TraceError
    from rannc.validate import CallOrderError, output_type_error

    assert (CheckpointError, CheckpointMismatchError, RankFailure, PlanInfeasibleError,
            ScheduleError, TraceError, CallOrderError) == (
        errors.CheckpointError, errors.CheckpointMismatchError, errors.RankFailure,
        errors.PlanInfeasibleError, errors.ScheduleError, errors.TraceError, errors.CallOrderError)
    assert output_type_error is errors.output_type_error and BlockOracle is BO and pn is param_names_of
    assert issubclass(EstimateOracle, BO)


def test_every_error_class_lives_in_errors() -> None:
    """rannc.errors holds every exception class (DESIGN.md): one place to read them all."""
    elsewhere = []
    for name, path in _modules().items():
        if name == "rannc.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (node.name.endswith(("Error", "Exception", "Failure"))):
                elsewhere.append(f"{name}.{node.name}")
    assert not elsewhere, elsewhere
