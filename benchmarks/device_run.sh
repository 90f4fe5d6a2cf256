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
# The second lease (2026-11-27, BENCHMARKS.md "The second lease"): what the first left, in its
# order: gpu_memory.py on BERT after the capture's mask fixes (expect it near plain PyTorch);
# attention_probe.py on the GPU (its one-call table in fp32 and bf16: which kernel keeps a
# boolean mask as a bias); gpu_study.py (never reached); beside them, runtime_peers.py for
# ResNet at 4 ranks, both models at 2, and the zero-bubble and interleaved schedules against
# torch.distributed.pipelining's at 4 ranks. (The first lease's lanes, gpu_memory on all
# models, selective.py, new_schedules.py and data_parallel.py: git history.) Build rannc._C
# first (setup.py build_ext): the planner needs it.
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

gpu="python3 benchmarks/gpu_memory.py --models bert --jsonl $OUT/gpu_memory.jsonl"
probe="python3 benchmarks/attention_probe.py"
study="python3 benchmarks/gpu_study.py --iters 10 --measure-seconds 1 --plot $OUT/gpu_study.png"
cpu="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1"
peers="$cpu python3 benchmarks/runtime_peers.py --repeats 3"
classic="--variants rannc_gpipe rannc_1f1b pipe_gpipe pipe_1f1b"
B=${LANE_SECONDS:-330}

lane gpu 0-3 "$B" "$gpu" "$probe" "$study" &
lane peers4 4-7 "$B" "$peers $classic --models resnet --ranks 4" &
lane peers2 8-9 "$B" "$peers $classic --models bert resnet --ranks 2" &
lane newsched 10-13 "$B" "$peers --new-schedules --models bert --ranks 4" &
wait
tail -n 40 "$OUT"/*.log
