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
# The second lease's second call (2026-11-27, BENCHMARKS.md "The second lease"): GPT-2 and
# Llama after the capture made their causal masks is_causal (memory against plain PyTorch,
# what attention saves), gpu_study's bf16 stage times now that the measure oracle runs under
# the capture's autocast; beside them the zero-bubble and interleaved schedules against
# torch.distributed.pipelining's at 4 ranks (without ScheduleZBVZeroBubble, killed in the
# first call), and torch.profiler op counts of rannc and pipelining 1F1B at 2 ranks with a
# core each ($OUT/prof). (The earlier calls' lanes: git history.) Build rannc._C first
# (setup.py build_ext): the planner needs it.
#
# Left for the next lease, in this order: a torch.profiler trace of one bf16 BERT-Large stage
# (gpu_study's shape: why bf16 stages take 1.5-2x the estimate: host issue rate, tensor-core
# efficiency, autocast's casts); runtime_peers --new-schedules at 8 and 16 microbatches (issue
# 19's zero-bubble target is for 8+); the ResNet 2-rank profile again with the heap and the
# input-row exchange in view. The device tool returns at most 8 files from $OUT: pack
# anything larger (profiles) into one tarball.
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

gpu="python3 benchmarks/gpu_memory.py --models gpt2 llama --rows 32 --jsonl $OUT/gpu_memory.jsonl"
probe="python3 benchmarks/attention_probe.py --models gpt2 llama --no-kernels"
study="python3 benchmarks/gpu_study.py --dtypes bf16 --iters 10 --measure-seconds 1"
cpu="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1"
peers="$cpu python3 benchmarks/runtime_peers.py"
new="--variants rannc_1f1b rannc_zb rannc_i1f1b rannc_zbv pipe_1f1b pipe_zb pipe_i1f1b"
prof="RUNTIME_PEERS_PROFILE=$OUT/prof $peers --repeats 1 --steps 8 --variants rannc_1f1b pipe_1f1b"
B=${LANE_SECONDS:-300}

mkdir -p "$OUT/prof"
lane gpu 0-3 "$B" "$gpu" "$probe" "$study" &
lane newsched 4-7 "$B" "$peers --repeats 2 $new --models bert --ranks 4" &
lane prof2 8-9 "$B" "$prof --models resnet --ranks 2" "$prof --models bert --ranks 2" &
wait
(cd "$OUT" && tar czf prof.tgz prof && rm -rf prof)  # (the tool returns at most 8 files)
tail -n 40 "$OUT"/*.log
