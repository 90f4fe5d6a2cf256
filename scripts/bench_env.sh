#!/usr/bin/env bash
# Creates .venv-bench (Python 3.11): rannc with its test dependencies, as scripts/setup_env.sh
# does for .venv, plus the peers of benchmarks/requirements.txt, whose partitioners
# benchmarks/plan_quality.py calls. The peers never enter .venv or rannc's dependencies.
#   bash scripts/bench_env.sh && PYTHONPATH=. .venv-bench/bin/python benchmarks/plan_quality.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
V=.venv-bench
if [ ! -x $V/bin/python ]; then
  "$PY" -m venv $V
fi
$V/bin/python -m pip install -q --upgrade pip >/dev/null
$V/bin/python -m pip install -q -c constraints.txt -e ".[test]"
want=$($V/bin/python -c "import torch; print(torch.__version__)")
# deepspeed is an sdist whose setup.py imports torch: build it against the torch already here
# (--no-build-isolation) instead of letting pip fetch another (CUDA) torch into a build env.
# DS_BUILD_OPS=0: no C++/CUDA ops are compiled; plan_quality.py only calls its partition
# functions (deepspeed.runtime.utils).
DS_BUILD_OPS=0 $V/bin/python -m pip install -q -c constraints.txt --no-build-isolation \
  -r benchmarks/requirements.txt
got=$($V/bin/python -c "import torch; print(torch.__version__)")
if [ "$want" != "$got" ]; then
  echo "bench_env.sh: installing the peers replaced torch $want with $got; remove $V and" \
       "check benchmarks/requirements.txt against constraints.txt" >&2
  exit 1
fi
echo "bench_env.sh: $V ready (torch $got)"
