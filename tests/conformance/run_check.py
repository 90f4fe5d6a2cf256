"""`python -m rannc.check` as a script, for tests/mpi_harness.py (which launches scripts), and as
a check script of tests/scripts/case_batch.py (`parse` and `run`: one layout's models, several
layouts in one launch)."""

from __future__ import annotations

import argparse
import sys

from rannc import dist as rdist
from rannc.check import _parser, _quiet, main, run_all, settings_from

PROCESS_GROUP_TIMEOUT_S = 120  # (rannc.check's own: RANNC_TIMEOUT_S unset)


def parse(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    """What `main` does on a launched rank, the process group left to the caller."""
    with _quiet():
        run_all(a.targets, settings_from(a))


if __name__ == "__main__":
    sys.exit(main())
