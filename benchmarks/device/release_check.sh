#!/usr/bin/env bash
# One device call on a one-GPU machine for a release of the tree: every GPU test, grouped by part
# (the peer kernels, strategies, engines' runtime and the timing protocol under MPS, since their
# ranks share the GPU; the models, e2e, CLI and probe without it), then the host-path benchmark
# and the quantized-epilogue benchmark, each step under its own time limit (a limit of 0 skips it).
# Logs come back packed in $OUT/logs.tar.gz beside the two rows files and $OUT/summary.txt:
#   OUT=/some/dir bash benchmarks/device/release_check.sh
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=160
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}"
OUT="${OUT:-$PWD/release_check_out}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
started=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ "$limit" = "0" ]; then echo "=== $name: skipped" | tee -a "$OUT/summary.txt"; return; fi
  echo "=== $name (limit ${limit}s, at $((SECONDS - started))s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started))s" | tee -a "$OUT/summary.txt"
}
pack() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . ; }
trap pack EXIT
# One test that hangs ends at its own limit (pytest-timeout, where installed) instead of its step's.
PER_TEST="$(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout=${TEST_TIMEOUT_S:-100})"
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider --durations=12 $PER_TEST -m 'gpu or multi_gpu'"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git log -1 --format='tree at %h %s' 2>/dev/null; } > "$OUT/summary.txt" 2>&1
nvidia-cuda-mps-control -d && echo "MPS on"
step "gpu tests: peer kernels and strategies (MPS)" "${PEER_TESTS_S:-230}" \
  bash -c "$PYTEST tests/strategies/test_peer.py tests/kernels tests/strategies/test_nccl_epilogue.py > $LOGS/peer_tests.txt 2>&1"
step "gpu tests: engines' runtime, calibration, timing, correctness, fabric (MPS)" "${ENGINE_TESTS_S:-90}" \
  bash -c "$PYTEST tests/integrations tests/test_timing.py tests/test_correctness.py tests/probe/test_fabric.py \
  > $LOGS/engine_tests.txt 2>&1"
echo quit | nvidia-cuda-mps-control && echo "MPS off"
step "gpu tests: models, e2e, diagnose, reference, cli, probe" "${OTHER_TESTS_S:-80}" \
  bash -c "$PYTEST tests/models tests/e2e tests/diagnose tests/test_reference.py tests/cli tests/probe \
  --ignore=tests/probe/test_fabric.py > $LOGS/other_tests.txt 2>&1"
step "host-path benchmark" "${HOST_PATH_S:-60}" \
  bash -c "python3 benchmarks/bench_host_path.py --out $OUT/host_path.jsonl > $LOGS/host_path.txt 2>&1"
step "quantized-epilogue benchmark" "${QUANT_S:-60}" \
  bash -c "cd benchmarks && python3 bench_quant.py --out $OUT/quant.jsonl ${QUANT_ARGS:---tokens 1 64 4096 16384 --hidden 6144} \
  > $LOGS/quant.txt 2>&1"
for f in peer_tests engine_tests other_tests; do
  { echo "--- $f"; grep -E "^(FAILED|ERROR)" "$LOGS/$f.txt" | head -20; tail -n 2 "$LOGS/$f.txt"; } >> "$OUT/summary.txt" 2>/dev/null
done
{ echo "--- host path"; tail -n 25 "$LOGS/host_path.txt"; echo "--- quant"; tail -n 30 "$LOGS/quant.txt"; } >> "$OUT/summary.txt" 2>/dev/null
echo "total $((SECONDS - started))s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
