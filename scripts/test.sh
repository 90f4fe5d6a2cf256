#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy) and run the tests (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check rannc tests examples benchmarks
.venv/bin/mypy rannc
.venv/bin/python -m pytest tests "$@"
