#!/usr/bin/env bash
# One device call on a one-GPU machine for the decode-size choices: the peer kernels' chunk size
# forced beside make_plan's (bench_peer_kernels.py --suite chunks, W ranks emulated as W streams:
# no fabric), the quantized epilogue's warps at 1-64 tokens (bench_quant.py --configs), and a
# verify A/B on 2 ranks sharing the GPU (the A-vs-A control's second baseline instance on CUDA).
# Usage, from the repository root: OUT=/some/dir bash benchmarks/device/decode_sweep.sh
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}" PYTHONPATH="$PWD/src:$PWD"
OUT="${OUT:-$PWD/decode_sweep_out}"
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
step "peer chunks" "${PEER_LIMIT:-200}" bash -c "python3 benchmarks/bench_peer_kernels.py --suite chunks \
  --budget-s ${PEER_BUDGET:-150} --out $OUT/peer_chunks.jsonl > $OUT/peer_chunks.log 2>&1"
step "quant decode" "${QUANT_LIMIT:-150}" bash -c "cd benchmarks && python3 bench_quant.py --out $OUT/quant_decode.jsonl \
  ${QUANT_ARGS:---tokens 1 64 --hidden 6144 --formats fp8_per_token fp8_per_group nvfp4 --trials 5 --configs 4:1 8:1 16:1} \
  > $OUT/quant_decode.log 2>&1"
nvidia-cuda-mps-control -d && echo "MPS on"
step "verify shared gpu" "${VERIFY_LIMIT:-90}" bash -c "python3 -m tpfuse.cli verify --world-size 2 --shared-gpu \
  --strategy oneshot --preset glm5 --max-tokens 4 --rounds 10 --json > $OUT/verify.json 2> $OUT/verify.log"
echo quit | nvidia-cuda-mps-control && echo "MPS off"
{ echo "--- peer chunks"; grep -v "^compiled" "$OUT/peer_chunks.log" | tail -n 40
  echo "--- quant decode"; grep -A40 "device copy" "$OUT/quant_decode.log"
  echo "--- verify"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('verdict'), d.get('baseline'), \
[(b['tokens'], b['verdict'], round(b['ratio'], 3), round(b['threshold'], 3)) for b in d.get('buckets', [])])" "$OUT/verify.json"
  tail -n 3 "$OUT/verify.log"; } >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
