#!/usr/bin/env bash
# One device call for the host path of a call: benchmarks/bench_host_path.py on one GPU (world size
# 1), then the GPU tests of the pre-bound epilogue launch and nccl_epilogue, each step under its own
# time limit; the benchmark's table is printed last.
#   OUT=/some/dir bash benchmarks/device/host_path.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
OUT="${OUT:-/tmp/tpfuse-host-path}"
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
timeout "${BENCH_S:-80}" python3 benchmarks/bench_host_path.py --out "$OUT/host_path.jsonl" > "$OUT/bench.txt" 2>&1
echo "bench exit $?" >> "$OUT/bench.txt"
timeout "${TESTS_S:-45}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_epilogue.py \
    tests/strategies/test_nccl_epilogue.py -k "(prebound and not quantized) or nccl_epilogue_world or (epilogue_on_gpu and 6144)" \
    > "$OUT/gpu_tests.txt" 2>&1
echo "tests exit $?" >> "$OUT/gpu_tests.txt"
timeout "${QUANT_S:-30}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_epilogue.py -k quantized \
    > "$OUT/gpu_tests_quant.txt" 2>&1
echo "quant tests exit $?" >> "$OUT/gpu_tests_quant.txt"
cat "$OUT/env.txt"; tail -4 "$OUT/gpu_tests.txt" "$OUT/gpu_tests_quant.txt"; cat "$OUT/bench.txt"
