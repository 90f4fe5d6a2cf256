"""The conformance suite's imports. `--full` (registered in tests/conftest.py, so that
`pytest tests --full` takes it too) or `CONFORMANCE_FULL=1` runs every model in every layout
(CI runs each model in one process and in one multi-rank layout)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `conformance.zoo` as the launched ranks import it
    sys.path.insert(0, str(HERE.parent))

