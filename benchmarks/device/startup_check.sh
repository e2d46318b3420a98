#!/usr/bin/env bash
# One device call for an engine's start on one GPU: the NCCL entry probe (host cost of the ways
# into NCCL, one rank, MPS off), then under MPS the start-up calibration's profile (2 ranks sharing
# the GPU, cold then warm kernel cache) and the calibration GPU test; each step under its own
# limit (0 skips it), the short tables printed last.
#   OUT=/some/dir bash benchmarks/device/startup_check.sh
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=160
OUT="${OUT:-$PWD/startup_check_out}"
mkdir -p "$OUT"
started=$SECONDS
step() {  # step NAME LIMIT_S LOG COMMAND...
  local name=$1 limit=$2 log=$3; shift 3
  if [ "$limit" = "0" ]; then echo "=== $name: skipped" | tee -a "$OUT/summary.txt"; return; fi
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - started))s" | tee -a "$OUT/summary.txt"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      'AsyncCompileMode', hasattr(triton, 'AsyncCompileMode'), 'cpus', __import__('os').cpu_count())"
  git log -1 --format='tree at %h %s' 2>/dev/null; } > "$OUT/summary.txt" 2>&1
step "nccl entry probe" "${PROBE_S:-90}" nccl_entry.txt \
  python3 benchmarks/device/nccl_entry_probe.py --out "$OUT/nccl_entry.jsonl"
nvidia-cuda-mps-control -d && echo "MPS on" >> "$OUT/summary.txt"
step "calibration profile" "${PROFILE_S:-300}" calibration_profile.txt \
  python3 benchmarks/device/calibration_profile.py --out "$OUT/calibration_profile.json"
step "calibration gpu test" "${CALIB_TEST_S:-200}" calibration_test.txt \
  env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/integrations/test_calibrate.py
echo quit | nvidia-cuda-mps-control
cat "$OUT/summary.txt"; cat "$OUT/nccl_entry.txt"; head -c 5000 "$OUT/calibration_profile.txt"
grep -E "passed|failed|starts until|calibrat" "$OUT/calibration_test.txt" | head -30
