"""Shared test set-up: the repository root on sys.path (for `examples.models`), quiet logs, and
`--full` (or CONFORMANCE_FULL=1): the slow runs, every conformance model in every layout and
the wheel test (tests/test_packaging.py)."""

from __future__ import annotations

import sys
from pathlib import Path

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked `full` repeat what a CI-run test already covers on another layout or model;
    # CI (2 cores) skips them so that the whole run stays well under its hour.
    if full_run(config):
        return
    skip = pytest.mark.skip(reason="slow, covered in CI by a sibling: runs with --full or CONFORMANCE_FULL=1")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
