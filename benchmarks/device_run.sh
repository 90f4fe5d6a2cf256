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
# The third lease's call (2026-11-28): the conformance cells that need torchvision and timm
# (skipped on the project's CPU host, where PyPI's torchvision does not load with the CPU torch),
# every layout (--full); beside them rannc against torch.distributed.pipelining on the same stages
# with a core per rank, each library's ranks given the same heap setting (--malloc reuse) and
# glibc's default, at 2 and 4 ranks; the new schedules at 8 microbatches (issue 19's target is for
# 8+); and on the GPU, where a bf16 BERT-Large iteration's time goes (gpu_profile.py: host issue,
# kernels, autocast's casts; plain PyTorch and rannc). (The earlier calls' lanes: git history.)
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

gpu="python3 benchmarks/gpu_profile.py --dtypes bf16 fp32 --iters 4"
conf="CUDA_VISIBLE_DEVICES= CONFORMANCE_FULL=1 OMP_NUM_THREADS=1 python3 -m pytest -v -p no:cacheprovider tests/conformance/test_conformance.py -k 'tv_resnet18 or tv_mobilenet_v3 or timm_vit'"
cpu="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1"
peers="$cpu python3 benchmarks/runtime_peers.py"
pair="--variants rannc_1f1b pipe_1f1b"
new="--variants rannc_1f1b rannc_zb rannc_i1f1b rannc_zbv pipe_1f1b pipe_zb pipe_i1f1b"
B=${LANE_SECONDS:-300}

lane gpu 0-1 "$B" "$gpu" &
lane conf 2-5 "$((B + 60))" "$conf" &
lane peers2 6-7 "$B" "$peers --repeats 3 --malloc reuse $pair --models resnet bert --ranks 2" \
  "$peers --repeats 2 $pair --models resnet --ranks 2" &
lane peers4 8-11 "$B" "$peers --repeats 3 --malloc reuse $pair --models bert resnet --ranks 4" &
lane newsched 12-15 "$B" "$peers --repeats 2 --microbatches 8 --batch 32 $new --models bert --ranks 4" &
wait
tail -n 40 "$OUT"/*.log
