#!/usr/bin/env bash
# One device call for a one-GPU machine: the foundation's doctor and selftest, the GPU tests of
# every part, then the per-part device scripts, each under its own time limit so that one slow
# part cannot starve the rest. Results go to a scratch directory and come back packed as
# $OUT/gpu_check.tar.gz (the device returns only a few files) plus $OUT/all.log:
#   foundation/  doctor.txt, doctor.json, selftest_ws1.txt, selftest_ws2_shared.json
#   gputests/    pytest -m gpu for every part (kernels and tune under MPS: ranks share the GPU)
#   tune/        benchmarks/device/gpu_check_tune.py (fabric tests, doctor --measure, tune + verify, 2 ranks on 1 GPU)
#   e2e/         benchmarks/device/gpu_check_e2e.py (bench e2e on a GLM-5 cut, profile)
#   diagnose/    benchmarks/device/diagnose_device_check.sh (diagnose over a 3-phase workload)
# Usage on the device machine, from the repository root:  OUT=/some/dir bash benchmarks/device/gpu_check_all.sh
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=160
OUT="${OUT:-$PWD/gpu_check_out}"
WORK="$(mktemp -d)"
FG="python3 -m tpfuse.cli"
mkdir -p "$OUT" "$WORK/foundation" "$WORK/gputests" "$WORK/tune" "$WORK/e2e" "$WORK/diagnose"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, say how it ended
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s"
}
pack() { tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" --exclude='trace*.json' . ; }
trap pack EXIT

F="$WORK/foundation"
step "doctor" 60 bash -c "$FG doctor > $F/doctor.txt 2>&1"
step "doctor --json" 60 bash -c "$FG doctor --json > $F/doctor.json 2> $F/doctor_json.err"
step "selftest --world-size 1" 90 bash -c "$FG selftest --world-size 1 > $F/selftest_ws1.txt 2>&1"
step "selftest --world-size 2 --shared-gpu" 90 \
  bash -c "$FG selftest --world-size 2 --shared-gpu --json > $F/selftest_ws2_shared.json 2> $F/selftest_ws2.err"
cat "$F/doctor.txt" "$F/selftest_ws1.txt"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('selftest ws2 shared-gpu passed:', d['passed'], [(r['strategy'], r['op'], r['dtype'], r['check']) for r in d['results'] if not r['passed']])" "$F/selftest_ws2_shared.json"

G="$WORK/gputests"
nvidia-cuda-mps-control -d && echo "MPS on"
step "gpu tests: kernels, tune" 150 bash -c "python3 -m pytest -q -rs -m 'gpu or multi_gpu' -p no:cacheprovider tests/kernels tests/probe/test_fabric.py tests/test_timing.py > $G/kernels_tune.txt 2>&1"
echo quit | nvidia-cuda-mps-control && echo "MPS off"
step "gpu tests: models, e2e, diagnose, references, cli, probe" 120 bash -c "python3 -m pytest -q -rs -m 'gpu or multi_gpu' -p no:cacheprovider tests/models tests/e2e tests/diagnose tests/test_reference.py tests/cli tests/probe --ignore=tests/probe/test_fabric.py > $G/others.txt 2>&1"
tail -n 15 "$G/kernels_tune.txt" "$G/others.txt"

step "tune + verify" 130 python3 benchmarks/device/gpu_check_tune.py --out-dir "$WORK/tune" --budget-s 120
step "bench e2e + profile" 120 python3 benchmarks/device/gpu_check_e2e.py --out-dir "$WORK/e2e" --budget-s 110 --no-tests
step "diagnose" 90 env OUT="$WORK/diagnose" bash benchmarks/device/diagnose_device_check.sh
echo "total $((SECONDS - started))s"
