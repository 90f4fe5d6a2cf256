"""Shared test set-up: the repository root on sys.path (for `examples.models`), quiet logs,
`--full` (or CONFORMANCE_FULL=1): the slow runs, every conformance model in every layout and
the wheel test (tests/test_packaging.py), and the three test layers.

Every test belongs to exactly one layer, declared with `pytest.mark.layer(NAME)` on its module
(`pytestmark`) or on the test (which overrides the module's), and selected by NAME: `pytest -m
pure` is the quick loop, `-m "not multi_rank"` needs no MPI.

    pure            no process group and no RaNNCModule: planning, schedules, graphs, configs
    single_process  one process (a world of one): the wrapper, capture, checkpoints, Trainer
    multi_rank      launches ranks (mpiexec, torchrun), directly or through a script

A layer is checked while its tests run, so a marker cannot drift from what the test does: a
pure test that starts a process group or wraps a model fails, and so does a test below
multi_rank that launches ranks (tests/mpi_harness.py reads PYTEST_LAYER)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="slow runs: every conformance model in every layout, the wheel test")


def full_run(config: pytest.Config) -> bool:
    """Whether this run takes the slow tests (`--full` or CONFORMANCE_FULL=1)."""
    import os

    return bool(config.getoption("--full")) or os.environ.get("CONFORMANCE_FULL", "") not in ("", "0")


LAYERS = ("pure", "single_process", "multi_rank")


def layer_of(item: pytest.Item) -> str | None:
    """The test's layer: its closest `layer` marker (the test's own, then its class's, module's)."""
    mark = item.get_closest_marker("layer")
    return str(mark.args[0]) if mark is not None and mark.args else None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these names
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [f"{item.nodeid} ({layer_of(item)})" for item in items if layer_of(item) not in LAYERS]
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) declare no layer or an unknown one, e.g. {wrong[:3]}: add "
            f"`pytestmark = pytest.mark.layer(NAME)` to the module or the marker to the test, NAME "
            f"one of {LAYERS} (tests/conftest.py says what each means)")
    for item in items:  # the name alone, on the test, so `-m pure` selects exactly its layer
        item.add_marker(str(layer_of(item)))
    # Tests marked `full` repeat what a CI-run test already covers on another layout or model;
    # CI (2 cores) skips them so that the whole run stays well under its hour.
    if full_run(config):
        return
    skip = pytest.mark.skip(reason="slow, covered in CI by a sibling: runs with --full or CONFORMANCE_FULL=1")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


class LayerBroken(Exception):
    """A test did what its layer rules out; the message names the marker to use."""


@pytest.fixture(autouse=True)
def _hold_layer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = layer_of(request.node) or ""
    monkeypatch.setenv("PYTEST_LAYER", layer)  # tests/mpi_harness.py refuses launches below multi_rank
    if layer != "pure":
        return
    import torch.distributed as dist

    import rannc

    def refuse(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise LayerBroken(f"{request.node.nodeid} is marked pure but {what}: mark it "
                              "single_process (or multi_rank if it launches ranks)")
        return call

    monkeypatch.setattr(dist, "init_process_group", refuse("starts a process group"))
    monkeypatch.setattr(rannc.RaNNCModule, "__init__", refuse("wraps a model in RaNNCModule"))
