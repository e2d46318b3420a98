#!/usr/bin/env bash
# One device call: spin 4's poll (sync.sources_asm) in three forms, each through
# bench_peer_kernels.py --suite spin (W ranks emulated as W streams on one GPU: no fabric):
# every source reloaded each retry or only those still missing (TPFUSE_POLL_ONLY_MISSING 0 / 1),
# and reloading only those with a 100 ns nanosleep between retries (TPFUSE_POLL_SLEEP_NS). The two variables
# exist only in the tree of the commit that adds this script.
# Usage, from the repository root: OUT=/some/dir bash benchmarks/device/poll_experiment.sh
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}" PYTHONPATH="$PWD/src:$PWD"
OUT="${OUT:-$PWD/poll_experiment_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
for form in "1 0" "0 0" "1 100"; do
  set -- $form
  tag="missing$1_sleep$2"
  echo "=== $tag at ${SECONDS}s"
  TPFUSE_POLL_ONLY_MISSING=$1 TPFUSE_POLL_SLEEP_NS=$2 timeout 150 python3 benchmarks/bench_peer_kernels.py --suite spin \
    --budget-s 35 --out "$OUT/$tag.jsonl" > "$OUT/$tag.log" 2>&1
  echo "=== $tag: exit $? at ${SECONDS}s"
  { echo "--- $tag"; grep "oneshot_emulated" "$OUT/$tag.log" | grep -v estimate; } >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
