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
# As run on 2026-11-27 (BENCHMARKS.md, "One H100 and 16 cores"). Left for the next lease, in
# this order: gpu_memory.py again (BERT after the capture's mask fixes: expect it near plain
# PyTorch); attention_probe.py (its one-call table in bf16: which kernel keeps a boolean mask
# as a bias); gpu_study.py (never reached); runtime_peers.py for ResNet at 4 ranks and both
# models at 2 (cut by their lanes' time). Build rannc._C first (setup.py build_ext): the
# planner needs it.
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
    timeout "$left" taskset -c "$cores" bash -c "$cmd" 2>&1 | grep -v "Warning\|warn(" 
  done >"$OUT/$name.log" 2>&1
}

gpu="python3 benchmarks/gpu_memory.py --jsonl $OUT/gpu_memory.jsonl"
sel="python3 benchmarks/selective.py --device cuda --dtype bf16 --layers 8 --hidden 2048 --seq 2048 --batch 4 --repeats 6"
study="python3 benchmarks/gpu_study.py --iters 10 --measure-seconds 1 --plot $OUT/gpu_study.png"
cpu="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1"
sched="$cpu python3 benchmarks/new_schedules.py --only measured --ranks 4 --model bert"
peers="$cpu python3 benchmarks/runtime_peers.py --repeats 4 --variants rannc_gpipe rannc_1f1b pipe_gpipe pipe_1f1b"
dp="$cpu python3 benchmarks/data_parallel.py --iters 24"
B=${LANE_SECONDS:-470}

lane gpu 0-1 "$B" "$gpu" "$sel" "$study" &
lane schedules 2-5 "$B" "$sched --microbatches 8 --steps 8" "$sched --microbatches 16 --steps 6" &
lane ddp 6-9 "$B" "$dp --launch 4 --model resnet" "$dp --launch 4 --model bert" "$dp --launch 2 --model resnet bert" &
lane peers4 10-13 "$B" "$peers --models bert --ranks 4" "$peers --models resnet --ranks 4" &
lane peers2 14-15 "$B" "$peers --models bert resnet --ranks 2" &
wait
tail -n 40 "$OUT"/*.log
