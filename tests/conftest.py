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
