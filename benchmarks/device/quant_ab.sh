#!/usr/bin/env bash
# One device call on a one-GPU machine for a change to the quantized epilogue: the quantizer's GPU
# tests (ranks sharing the GPU under MPS), then benchmarks/bench_quant.py for the tree in $BEFORE
# (a `src` exported from an earlier commit, optional) and for this tree, alternately, so both sets
# of rows come from the same machine and hour. Usage, from the repository root:
#   mkdir -p .cache/before && git archive <commit> src | tar -x -C .cache/before   # here, with git
#   OUT=/some/dir BEFORE=.cache/before bash benchmarks/device/quant_ab.sh
# (the device call carries .cache/before). QUANT_ARGS replaces the benchmark's arguments; AFTER_ARGS
# adds to them for this tree only (e.g. "--configs 8:1 16:2", launch configurations to compare).
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}"
OUT="${OUT:-$PWD/quant_ab_out}"
mkdir -p "$OUT"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/summary.txt"
nvidia-cuda-mps-control -d && echo "MPS on"
step "gpu tests" "${TEST_LIMIT:-150}" env PYTHONPATH="$PWD/src:$PWD" bash -c "python3 -m pytest -q -rs \
  -p no:cacheprovider -m gpu ${TESTS:-tests/kernels/test_quant.py} > $OUT/gpu_tests.txt 2>&1"
echo quit | nvidia-cuda-mps-control && echo "MPS off"
ARGS="${QUANT_ARGS:---tokens 1 64 4096 16384 --hidden 6144 --trials 5}"
bench() {  # bench SRC OUTFILE LOG [EXTRA ARGS]
  step "bench_quant ($1)" "${QUANT_LIMIT:-120}" env PYTHONPATH="$PWD/$1" bash -c \
    "cd benchmarks && python3 bench_quant.py --out $2 $ARGS ${4:-} > $3 2>&1"
}
if [ -n "${BEFORE:-}" ]; then bench "$BEFORE/src" "$OUT/quant_before.jsonl" "$OUT/quant_before.log"; fi
bench src "$OUT/quant.jsonl" "$OUT/quant.log" "${AFTER_ARGS:-}"
{ echo "--- tests"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20; tail -n 3 "$OUT/gpu_tests.txt"
  [ -n "${BEFORE:-}" ] && { echo "--- before"; grep -A30 "device copy" "$OUT/quant_before.log"; }
  echo "--- after"; grep -A60 "device copy" "$OUT/quant.log"; } >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
