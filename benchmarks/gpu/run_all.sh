#!/usr/bin/env bash
# Every GPU measurement in one command: at most 580 s of step limits (160 + 105 + 4 x 30 +
# 80 + 55 + 40 + 20), inside the device tool's 600 s per command; about 6-7 minutes when
# nothing hangs:
#   1. the one-GPU fidelity benchmark (4 stages on one device, CUDA streams): fidelity_gpu.py
#   2. the CUDA tests (pytest -m requires_cuda: tests/gpu, tests/e2e's CUDA-stream matrix)
#   3. where the peak memory goes, with and without CUDA_LAUNCH_BLOCKING: memory_breakdown.py
#   4. the named-GPU model against the GPU itself: preset_vs_measured.py
#   5. the local runtime issued from one thread, a thread per rank, and as CUDA graphs
#      (4 stages of a small GPT-2 on cuda:0): issue_threads.py
#   6. the distributed runtime's CUDA path on a torchrun world of one rank (NCCL, placement,
#      numerics, the NCCL refusals, a checkpoint saved and loaded): nccl_world1.py
#   7. GPT-OSS's attention with sinks, eager against the capture's fused attention (time,
#      peak, the analytical price of each, the differences): sink_attention.py (log only)
# Needs a Python with a CUDA build of torch and this package installed (`make setup
# TORCH_SPEC='torch>=2.6'`, or PYTHON=python3 where the package is installed into it).
# Writes 8 files into $OUT (default benchmarks/gpu/out; the device tool returns at most 8): environment.txt, log.txt (everything
# printed), cuda_tests.txt and each script's JSON / trace / PNG. Each step has its own time
# limit, so one that hangs leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-benchmarks/gpu/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
quiet() { grep -v -e '^USDT' -e '^DEBUG' -e "^{'checkpoint_id'"; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  "$PY" -c "import torch, platform, transformers, ortools; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'ortools', ortools.__version__)"; } 2>&1 | tee "$OUT/environment.txt"
echo "== fidelity_gpu.py" | tee -a "$LOG"
timeout 160 "$PY" benchmarks/gpu/fidelity_gpu.py --out "$OUT" 2>&1 | quiet | tee -a "$LOG" | tail -25
echo "== CUDA tests" | tee -a "$LOG"
timeout 105 "$PY" -m pytest -q -p no:cacheprovider -p no:logging -m requires_cuda --tb=short tests 2>&1 | quiet > "$OUT/cuda_tests.txt"
tail -30 "$OUT/cuda_tests.txt" | tee -a "$LOG"
echo "== memory_breakdown.py" | tee -a "$LOG"
for model in zoo-gpt2 fidelity-gpt2; do
  for blocking in 0 1; do
    CUDA_LAUNCH_BLOCKING=$blocking timeout 30 "$PY" benchmarks/gpu/memory_breakdown.py --model $model \
      --out "$OUT/mem.json" 2>&1 | quiet | tail -3 >> "$LOG"
    cat "$OUT/mem.json" >> "$OUT/memory_breakdown.jsonl" 2>/dev/null; rm -f "$OUT/mem.json"
  done
done
echo "== preset_vs_measured.py" | tee -a "$LOG"
timeout 80 "$PY" benchmarks/gpu/preset_vs_measured.py --out "$OUT" 2>&1 | quiet | tee -a "$LOG" | tail -12
echo "== issue_threads.py" | tee -a "$LOG"
timeout 55 "$PY" benchmarks/gpu/issue_threads.py --devices cuda:0,cuda:0,cuda:0,cuda:0 \
  --microbatches 8 --steps 7 --rounds 2 --out "$OUT" 2>&1 | quiet | tee -a "$LOG" | tail -4
echo "== nccl_world1.py" | tee -a "$LOG"
timeout 40 "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 \
  benchmarks/gpu/nccl_world1.py 2>&1 | quiet | grep -v -i warn | tee -a "$LOG" | tail -8
echo "== sink_attention.py" | tee -a "$LOG"
timeout 20 "$PY" benchmarks/gpu/sink_attention.py --device cuda 2>&1 | quiet | tee -a "$LOG" \
  | tail -4
date -u | tee -a "$OUT/environment.txt"
