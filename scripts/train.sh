#!/usr/bin/env bash
# The main job: set up, then pre-train a small BERT through rannc on 4 CPU ranks (mpiexec,
# gloo) as 2 pipeline stages x 2 replicas with 2 microbatches, printing the layout and the loss.
# Arguments go to examples/train_bert.py (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RANNC_BACKEND=${RANNC_BACKEND:-gloo}
export RANNC_PARTITION_NUM=${RANNC_PARTITION_NUM:-2} RANNC_MICROBATCHES=${RANNC_MICROBATCHES:-2}
exec .venv/bin/mpiexec -n "${RANNC_NP:-4}" .venv/bin/python examples/train_bert.py "$@"
