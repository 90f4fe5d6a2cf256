#!/usr/bin/env bash
# The conformance suite (tests/conformance): real architectures under rannc against the
# unwrapped model on the global batch. Arguments go to pytest:
#   bash scripts/conformance.sh                 # the CI set: every model in one process and one layout
#   bash scripts/conformance.sh --full          # every model in every layout (slow)
#   bash scripts/conformance.sh --full -k llama # one model everywhere
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/conformance -rA "$@"
