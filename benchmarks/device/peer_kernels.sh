#!/usr/bin/env bash
# One device call for the peer kernels on a one-GPU machine: the emulated-peer latency benchmark
# (benchmarks/bench_peer_kernels.py, MPS off: one process), then the kernels' GPU tests with ranks
# sharing the GPU under MPS. Usage, from the repository root:
#   OUT=/some/dir BENCH_ARGS="--budget-s 300" TEST_LIMIT=240 TESTS="tests/..." TEST_K="not epilogue" \
#     bash benchmarks/device/peer_kernels.sh
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/peer_out}"
mkdir -p "$OUT"
started=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "=== benchmark (at $((SECONDS - started)) s)"
timeout "${BENCH_LIMIT:-420}" python3 benchmarks/bench_peer_kernels.py --out "$OUT/peer_kernels_emulated.jsonl" \
  --plot "$OUT/peer_kernels_emulated.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^  warn\|UserWarning"
echo "=== benchmark exit $? (at $((SECONDS - started)) s)"
if [ "${TEST_LIMIT:-0}" -gt 0 ]; then
  nvidia-cuda-mps-control -d && echo "MPS on"
  timeout "$TEST_LIMIT" python3 -m pytest -q -rs -p no:cacheprovider -k "${TEST_K:-}" \
    ${TESTS:-tests/kernels/test_gpu_faults.py tests/kernels/test_gpu.py} > "$OUT/gpu_tests.txt" 2>&1
  echo "=== gpu tests exit $? (at $((SECONDS - started)) s)"; tail -25 "$OUT/gpu_tests.txt"
  echo quit | nvidia-cuda-mps-control
fi
