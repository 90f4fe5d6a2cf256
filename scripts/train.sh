#!/usr/bin/env bash
# The main job: set up, then pre-train a small BERT through rannc for a few steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/train_bert.py "$@"
