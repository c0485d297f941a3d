#!/usr/bin/env bash
# Every GPU measurement in one command (budget: under 9 minutes on one H100):
# the CUDA tests, then the one-GPU fidelity benchmark (4 stages on one device, CUDA streams).
# Needs a Python with a CUDA build of torch and this package installed (`make setup
# TORCH_SPEC='torch>=2.6'`); writes into $OUT (default benchmarks/gpu/out).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-benchmarks/gpu/out}"
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  "$PY" -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/environment.txt"
timeout 240 "$PY" -m pytest -q -m requires_cuda tests 2>&1 | tail -20 | tee "$OUT/cuda_tests.txt"
timeout 270 "$PY" benchmarks/gpu/fidelity_gpu.py --out "$OUT" 2>&1 | tail -20 | tee "$OUT/fidelity_gpu.txt"
