#!/usr/bin/env bash
# One device call on a one-GPU machine for the polls' launch options (spin 3: a tag wait first;
# spin 4: every source polled at once): a bench_peer_kernels.py suite (PEER_SUITE, default spin:
# the one-shot decode kernel at spin 2, 3 and 4; twoshot_poll: two-shot chunk owners at spin 2
# and 4; W ranks emulated as W streams: no fabric), the GPU tiers of the kernels (KERNEL_TESTS,
# default tests/kernels/test_sync.py and test_oneshot.py; KERNEL_K selects with pytest -k), then
# processes sharing the GPU under MPS: the peer strategies' GPU tests selected by PEER_TESTS_K
# (pytest -k; default: those the earlier calls' limits did not reach; "none" skips them).
# Usage, from the repository root: OUT=/some/dir bash benchmarks/device/spin_check.sh
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}" PYTHONPATH="$PWD/src:$PWD"
OUT="${OUT:-$PWD/spin_check_out}"
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
step "peer ${PEER_SUITE:-spin}" "${PEER_LIMIT:-190}" bash -c "python3 benchmarks/bench_peer_kernels.py --suite ${PEER_SUITE:-spin} \
  --budget-s ${PEER_BUDGET:-140} --out $OUT/peer_spin.jsonl > $OUT/peer_spin.log 2>&1"
step "kernel gpu tests" "${KERNEL_LIMIT:-150}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  ${KERNEL_TESTS:-tests/kernels/test_sync.py tests/kernels/test_oneshot.py} ${KERNEL_K:+-k '$KERNEL_K'} \
  > $OUT/kernel_tests.log 2>&1"
if [[ "${PEER_TESTS_K:-}" != none ]]; then
nvidia-cuda-mps-control -d && echo "MPS on"
step "peer strategy gpu tests" "${PEER_TESTS_LIMIT:-200}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/strategies/test_peer.py -k '${PEER_TESTS_K:-(straggler and twoshot) or skewed or negative_zero or larger_eager or two_streams}' \
  > $OUT/peer_tests.log 2>&1"
echo quit | nvidia-cuda-mps-control && echo "MPS off"
fi
{ echo "--- peer ${PEER_SUITE:-spin}"; grep -v "^compiled" "$OUT/peer_spin.log" | grep -v "^estimate" | head -n 40
  echo "--- kernel gpu tests"; tail -n 40 "$OUT/kernel_tests.log"
  [[ -f "$OUT/peer_tests.log" ]] && { echo "--- peer strategy gpu tests"; tail -n 15 "$OUT/peer_tests.log"; }; } >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
