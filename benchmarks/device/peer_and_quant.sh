#!/usr/bin/env bash
# One device call on a one-GPU machine: the peer kernels' emulated-peer benchmark, the quantized
# epilogue benchmark, then chosen GPU tests under MPS, each step under its own time limit (a limit
# of 0 skips the step). Usage, from the repository root:
#   OUT=/some/dir bash benchmarks/device/peer_and_quant.sh
# PEER_ARGS: benchmarks/bench_peer_kernels.py arguments (default: the reported grid, --suite final);
# QUANT_ARGS, TESTS: the quant benchmark's arguments and the pytest arguments. Triton's cache is
# shared by every step (the benchmark compiles in parallel first; tests then load what it built).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}"
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ "$limit" = "0" ]; then echo "=== $name: skipped"; return; fi
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
step "peer benchmark" "${PEER_LIMIT:-300}" bash -c "python3 benchmarks/bench_peer_kernels.py \
  --out $OUT/peer_kernels_emulated.jsonl --plot $OUT/peer_kernels_emulated.png ${PEER_ARGS:---suite final} \
  > $OUT/peer.log 2>&1"
step "quant benchmark" "${QUANT_LIMIT:-170}" bash -c "cd benchmarks && python3 bench_quant.py --out $OUT/quant.jsonl \
  ${QUANT_ARGS:---tokens 1 64 4096 16384 --hidden 6144 7168} > $OUT/quant.log 2>&1"
nvidia-cuda-mps-control -d && echo "MPS on"
step "gpu tests" "${TEST_LIMIT:-240}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider ${TESTS:-tests/kernels/test_sync.py \
  tests/kernels/test_oneshot.py tests/kernels/test_twoshot.py tests/strategies/test_peer.py tests/kernels/test_quant.py -m gpu} \
  > $OUT/gpu_tests.txt 2>&1"
echo quit | nvidia-cuda-mps-control
tail -4 "$OUT/gpu_tests.txt" 2>/dev/null; grep -E "FAILED|Error" "$OUT/gpu_tests.txt" 2>/dev/null | head -20
[ -f "$OUT/quant.log" ] && tail -45 "$OUT/quant.log"
grep -E "FAILED|INVALID|compiled|budget" "$OUT/peer.log" | head -30
sed -n '/ rows in /,$p' "$OUT/peer.log" | cut -c1-150
