"""`python -m rannc.check` as a script, for tests/mpi_harness.py (which launches scripts)."""

from __future__ import annotations

import sys

from rannc.check import main

if __name__ == "__main__":
    sys.exit(main())
