#!/usr/bin/env bash
# One device call on a one-GPU machine for the quantized epilogue: the GPU tests of the quantizer,
# an Nsight Compute profile of each format's kernel before / after / variants
# (benchmarks/device/quant_profile.py), then benchmarks/bench_quant.py beside FlashInfer's fused
# kernels and torch.compile, each step under its own time limit. Usage, from the repository root:
#   python benchmarks/device/quant_profile.py prepare --commit 38f0a72 --dir .cache/before   # with git
#   OUT=/some/dir bash benchmarks/device/quant_profile.sh
# Wheels in .whl/ (FlashInfer and what it imports that the device lacks) are installed first;
# FlashInfer's norm module is JIT-built with the device's nvcc in the background meanwhile.
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
# at most 8 files come back from a device call: the small logs share misc.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/misc.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  export FLASHINFER_WORKSPACE_BASE="$PWD/.cache" FLASHINFER_CUDA_ARCH_LIST="9.0"
  (timeout "${FI_LIMIT:-150}" python3 -c "import flashinfer.norm as n; n.get_norm_module(); print('flashinfer norm built')" \
    > /tmp/flashinfer_build.log 2>&1; echo "exit $?" >> /tmp/flashinfer_build.log) &
  fi_build=$!
fi
step "gpu tests" "${TEST_LIMIT:-60}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  ${TESTS:-tests/kernels/test_quant.py -k 'not ranks_sharing and not peer_calls and not nccl'} > $OUT/gpu_tests.txt 2>&1"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step "ncu profile" "${NCU_LIMIT:-80}" "$NCU" --clock-control none --target-processes all -k regex:residual_rmsnorm \
  --page raw --csv --print-units base --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section WarpStateStats --section SchedulerStats --log-file "$OUT/ncu.csv" \
  python3 benchmarks/device/quant_profile.py launch --before .cache/before --labels "$OUT/ncu_labels.json" \
  ${PROFILE_ARGS:-} > /tmp/ncu_run.log 2>&1
python3 benchmarks/device/quant_profile.py summarize "$OUT/ncu.csv" "$OUT/ncu_labels.json" --out "$OUT/quant_profile.jsonl" \
  > /tmp/ncu_summary.txt 2>&1
[ -n "${fi_build:-}" ] && wait "$fi_build"
step "quant benchmark" "${QUANT_LIMIT:-150}" bash -c "cd benchmarks && python3 bench_quant.py --out $OUT/quant.jsonl \
  ${QUANT_ARGS:---tokens 1 64 4096 16384 --hidden 6144 7168 --trials 5} > $OUT/quant.log 2>&1"
cat /tmp/flashinfer_build.log /tmp/ncu_run.log /tmp/ncu_summary.txt >> "$OUT/misc.log" 2>/dev/null
tail -3 /tmp/flashinfer_build.log 2>/dev/null
tail -3 "$OUT/gpu_tests.txt"; grep -E "FAILED|Error" "$OUT/gpu_tests.txt" | head -10
tail -3 /tmp/ncu_run.log; cat /tmp/ncu_summary.txt
tail -42 "$OUT/quant.log"
