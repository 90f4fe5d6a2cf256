#!/usr/bin/env bash
# Creates .venv (Python 3.11) if it is missing and installs rannc with its test
# dependencies, pinned by constraints.txt (torch 2.13.0: the CPU build on these
# machines). Safe to run again: pip only rebuilds rannc's C++ extension.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
