#!/usr/bin/env bash
# One device call for a one-GPU machine: the foundation's doctor and selftest, then the three
# per-part device scripts, each under its own time limit so that one slow part cannot starve the
# rest. Everything lands under $OUT (default ./gpu_check_out):
#   foundation/  doctor.txt, doctor.json, selftest_ws1.txt, selftest_ws2_shared.json
#   tune/        benchmarks/gpu_check_tune.py (fabric tests, doctor --measure, tune + verify, 2 ranks on 1 GPU)
#   e2e/         benchmarks/gpu_check_e2e.py (bench e2e on a GLM-5 cut, profile, model GPU tests)
#   diagnose/    benchmarks/diagnose_device_check.sh (diagnose over a 3-phase workload)
# Usage on the device machine, from the repository root:  bash benchmarks/gpu_check_all.sh
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=160
OUT="${OUT:-$PWD/gpu_check_out}"
FG="python3 -m fusegate.cli"
mkdir -p "$OUT/foundation" "$OUT/tune" "$OUT/e2e" "$OUT/diagnose"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, say how it ended
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s"
}

F="$OUT/foundation"
step "doctor" 60 bash -c "$FG doctor > $F/doctor.txt 2>&1"
step "doctor --json" 60 bash -c "$FG doctor --json > $F/doctor.json 2> $F/doctor_json.err"
step "selftest --world-size 1" 90 bash -c "$FG selftest --world-size 1 > $F/selftest_ws1.txt 2>&1"
step "selftest --world-size 2 --shared-gpu" 90 \
  bash -c "$FG selftest --world-size 2 --shared-gpu --json > $F/selftest_ws2_shared.json 2> $F/selftest_ws2.err"
cat "$F/doctor.txt" "$F/selftest_ws1.txt"

step "tune + verify" 160 python3 benchmarks/gpu_check_tune.py --out-dir "$OUT/tune" --budget-s 150
step "bench e2e + profile" 215 python3 benchmarks/gpu_check_e2e.py --out-dir "$OUT/e2e" --budget-s 205
step "diagnose" 90 env OUT="$OUT/diagnose" bash benchmarks/diagnose_device_check.sh
echo "total $((SECONDS - started))s"
