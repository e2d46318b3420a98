#!/usr/bin/env bash
# One device call on a one-GPU machine: the peer kernels' emulated-peer benchmark, the quantized
# epilogue benchmark, then the GPU tests of the kernels, quantization and timing under MPS, each
# step under its own time limit. Usage, from the repository root:
#   OUT=/some/dir bash benchmarks/device/peer_and_quant.sh
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
step "peer benchmark" "${PEER_LIMIT:-240}" bash -c "python3 benchmarks/bench_peer_kernels.py --out $OUT/peer_kernels_emulated.jsonl \
  --plot $OUT/peer_kernels_emulated.png ${PEER_ARGS:---budget-s 180} > $OUT/peer.log 2>&1"
step "quant benchmark" "${QUANT_LIMIT:-170}" bash -c "cd benchmarks && python3 bench_quant.py --out $OUT/quant.jsonl \
  ${QUANT_ARGS:---tokens 1 64 4096 16384 --hidden 6144 7168} > $OUT/quant.log 2>&1"
nvidia-cuda-mps-control -d && echo "MPS on"
step "gpu tests" "${TEST_LIMIT:-240}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider -m "not interpreter" ${TESTS:-tests/kernels/test_gpu_faults.py \
  tests/kernels/test_quant.py tests/test_timing_gpu.py tests/kernels/test_gpu.py} > $OUT/gpu_tests.txt 2>&1"
echo quit | nvidia-cuda-mps-control
tail -4 "$OUT/gpu_tests.txt"; grep -E "FAILED|Error" "$OUT/gpu_tests.txt" | head -20
tail -45 "$OUT/quant.log"
grep -E "^all_reduce|^empty|^residual|^device|INVALID|FAILED" "$OUT/peer.log" | grep -E " (1|8) .*6144|INVALID|FAILED|empty" | head -60
