#!/usr/bin/env bash
# Tree-kernel checks and timings on a lent NVIDIA GPU (under 8 minutes; installs nothing, uses the box's torch and
# triton):  bash benchmarks/gpu_kernels.sh 2>&1 | tee "$OUT/gpu_kernels.log"   (the output is about 12 KB)
# CPU smoke test (Triton interpreter):  PYTHON=.venv/bin/python bash benchmarks/gpu_kernels.sh --smoke
# It runs the Python of its caller: $PYTHON when set (the test suite passes its own), else python3 on the PATH
# (an activated venv's, or the box's); never one picked behind the caller's back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
# the GPU run must compile the kernels, not interpret them (an inherited TRITON_INTERPRET=1 would)
[ "${1:-}" = --smoke ] || unset TRITON_INTERPRET
exec timeout 470 "$PY" benchmarks/gpu_kernels.py "$@"
