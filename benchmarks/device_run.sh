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
# The fourth lease ran this (BENCHMARKS.md "The fourth lease"). Prepared before it (the third lease's calls: git history, f3c3d91 and 576ba6f; results
# in BENCHMARKS.md "The third lease"): issue 19's zero-bubble, interleaved and ZB-V rows against
# torch.distributed.pipelining at 8 and 16 microbatches on 4 ranks (runtime_peers now cuts both
# libraries' stages evenly by layers where rannc's moved cuts would meet: the third lease's lane
# stopped on "cannot mirror it"); the conformance cells the third lease's time cut (the second
# half of the zoo in 4r-rep211-m4-zb and 2r-pn2-m4-zb-sel); and on the GPU gpu_profile.py again
# with its corrected kernel count (BERT-Large, bf16 and fp32), beside gpu_study's stage table, to
# calibrate a host term for the estimate oracle (about 19 us per kernel in bf16 on the H100
# host). Build rannc._C first (setup.py build_ext): the planner needs it. The device tool
# returns at most 8 files from $OUT.
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
cpu="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1"
peers="$cpu python3 benchmarks/runtime_peers.py --repeats 2 --models bert --layers 8 --ranks 4"
# 8 layers: the interleaved plans cut 8 stages on 4 ranks, one layer each at least
# (pipelining's ScheduleZBVZeroBubble fails at start-up under torch 2.11 and gloo, and a failed
# launch stops the lane: left out)
new="--variants rannc_1f1b rannc_zb rannc_i1f1b rannc_zbv pipe_1f1b pipe_zb pipe_i1f1b"
B=${LANE_SECONDS:-300}

lane gpu 0-1 "$B" "python3 benchmarks/gpu_profile.py --dtypes bf16 fp32 --iters 4" \
  "python3 benchmarks/gpu_study.py --dtypes bf16 --iters 6 --measure-seconds 1" &
lane new8 2-5 "$B" "$peers --microbatches 8 --batch 32 $new" &
lane new16 6-9 "$B" "$peers --microbatches 16 --batch 64 $new" &
lane zb_b 10-13 "$B" "$(conf 4r-rep211-m4-zb 1)" &
lane sel_b 14-15 "$B" "$(conf 2r-pn2-m4-zb-sel 1)" &
wait
tail -n 25 "$OUT"/*.log
