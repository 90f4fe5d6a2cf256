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
# Prepared for the sixth lease: the GPU lane first measures the memory forecast with the loop
# that holds its outputs (gpu_memory.py --loop hold; the fp32 cells read 0.81-0.87 with Trainer's
# loop in the second lease, and the CPU at that shape gives 0.99 with hold), and zero-bubble's
# input pass now releases what only it reads (rannc_zb's row in the zb16 lane).
# Prepared for the fifth lease (the fourth's calls: fac5d4a and BENCHMARKS.md "The fourth lease"):
# gpu_study's predicted column now includes the estimate's host floor (DeviceSpec.host_per_op,
# calibrated on the fourth lease's BERT-Large bf16 stages: check it on the GPU, the two-stage
# split above all); issue 19's runtime cells after the labels stopped travelling to the first
# stage (BERT 2 ranks 1.00 of pipelining on 2 cores), with four repeats each, both libraries on
# one heap setting; one stage x 4 replicas against DDP (rannc_auto's pair); zero-bubble at 16
# microbatches again (0.99x rannc's 1F1B in the fourth lease, 1.07x at 8). Each lane reports
# its own rows; the lanes run side by side, so compare within a lane.
# Build rannc._C first (setup.py build_ext): the planner needs it. The device tool
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
# (8 layers: an interleaved or ZB-V plan cuts 8 stages on 4 ranks, a layer each at least)
peers="$cpu python3 benchmarks/runtime_peers.py --repeats 3 --models bert --layers 8 --ranks 4"
# (pipelining's ScheduleZBVZeroBubble fails at start-up under torch 2.11 and gloo, and a failed
# launch stops the lane: not among the variants)
B=${LANE_SECONDS:-300}

lane gpu 0-1 "$B" "python3 benchmarks/gpu_memory.py --loop hold --rows 8 32" \
  "python3 benchmarks/gpu_study.py --dtypes bf16 --iters 6 --measure-seconds 1" \
  "python3 benchmarks/gpu_profile.py --dtypes bf16 --iters 4" &
lane peers4 2-5 "$B" "$cpu python3 benchmarks/runtime_peers.py --repeats 4 --malloc reuse --models bert resnet --ranks 4 --variants rannc_1f1b pipe_1f1b" &
lane peers2 6-7 "$B" "$cpu python3 benchmarks/runtime_peers.py --repeats 4 --malloc reuse --models bert resnet --ranks 2 --variants rannc_1f1b pipe_1f1b rannc_gpipe pipe_gpipe" &
lane ddp 8-11 "$B" "$cpu python3 benchmarks/runtime_peers.py --repeats 4 --malloc reuse --models resnet bert --ranks 4 --variants rannc_auto ddp" &
lane zb16 12-15 "$B" "$peers --microbatches 16 --batch 64 --variants rannc_1f1b rannc_zb rannc_zbv pipe_zb" &
wait
tail -n 25 "$OUT"/*.log
