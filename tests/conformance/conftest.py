"""`--full`: every model in every layout (CI runs each model in one process and in one
multi-rank layout). `CONFORMANCE_FULL=1` does the same where the option is not available
(pytest reads this file's options only when tests/conformance is on its command line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `conformance.zoo` as the launched ranks import it
    sys.path.insert(0, str(HERE.parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="conformance suite: every model in every layout (slow)")
