#!/usr/bin/env bash
# One lease of a one-GPU machine with 16 cores (the workplace's device tool), all checks in one
# command: the GPU lane (memory forecast against torch.cuda.max_memory_allocated, selective
# recomputation's cost, rannc vs plain on BERT-Large) beside CPU lanes that give every gloo rank
# a core of its own (the measured schedule and runtime targets, which 2 shared cores cannot
# show). Each lane is pinned to its own cores with taskset; logs go to $OUT.
#
#   bash benchmarks/device_run.sh            # on the device machine, from the repository root
#
# Needs the mpich and mpi4py wheels for its Python in .whl/ (README of the device tool).
#
# The third lease's second call (2026-11-28): the conformance suite's --full cells of the
# layouts CI covers with a few models only, for every model of the zoo: zero-bubble with
# replicas per stage (4r-rep211-m4-zb), interleaved stages (3r-rep12-pn4-m4-il) and selective
# recomputation under zero-bubble (2r-pn2-m4-zb-sel), each split in two lanes by model (one
# pytest per lane: the suite launches a layout's models together, so lanes split by -k). The
# torchvision and timm models load there. (The first call's lanes: git history, f3c3d91.)
# Build rannc._C first (setup.py build_ext): the planner needs it. The device tool returns at
# most 8 files from $OUT.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl
  ls "$(dirname "$(command -v python3)")"/mpiexec
  python3 setup.py build_ext --inplace -j 8 >/dev/null && ls rannc/_C*.so
} >"$OUT/setup.log" 2>&1

lane() {  # lane NAME CORES SECONDS COMMAND...: one lane's commands, each under the lane's budget
  local name=$1 cores=$2 limit=$3; shift 3
  local end=$((SECONDS + limit))
  for cmd in "$@"; do
    local left=$((end - SECONDS))
    ((left > 20)) || { echo "== skipped (lane budget spent): $cmd"; continue; }
    echo "== $(date +%T) $cmd"
    timeout -k 10 "$left" taskset -c "$cores" bash -c "$cmd" 2>&1 | grep --line-buffered -v "Warning\|warn("
  done >"$OUT/$name.log" 2>&1
}

models=$(PYTHONPATH=tests python3 -c "from conformance.zoo import MODELS; print(' '.join(MODELS))")
half() {  # half 0|1: a -k expression for the first or second half of the zoo's models
  python3 -c "import sys; ms = sys.argv[2:]; h = int(sys.argv[1]); k = len(ms) // 2
print(' or '.join(f'-{m}' for m in (ms[:k] if h == 0 else ms[k:])))" "$1" $models
}
conf() {  # conf LAYOUT HALF: that layout's cells for that half of the models
  echo "CUDA_VISIBLE_DEVICES= CONFORMANCE_FULL=1 OMP_NUM_THREADS=1 python3 -m pytest -v -p no:cacheprovider tests/conformance/test_conformance.py -k '$1 and ($(half "$2"))'"
}
B=${LANE_SECONDS:-330}

lane zb_a 0-3 "$B" "$(conf 4r-rep211-m4-zb 0)" &
lane zb_b 4-7 "$B" "$(conf 4r-rep211-m4-zb 1)" &
lane il_a 8-10 "$B" "$(conf 3r-rep12-pn4-m4-il 0)" &
lane il_b 11-13 "$B" "$(conf 3r-rep12-pn4-m4-il 1)" &
lane sel 14-15 "$B" "$(conf 2r-pn2-m4-zb-sel 0)" &
wait
grep -h -E "PASSED|FAILED|ERROR|passed|failed" "$OUT"/*.log | grep -v "^E " | sed "s/.*test_conformance.py:://" | grep -v PASSED
