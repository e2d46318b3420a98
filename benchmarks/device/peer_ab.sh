#!/usr/bin/env bash
# One device call on a one-GPU machine comparing the peer kernels of several trees: the emulated-peer
# benchmark (benchmarks/bench_peer_kernels.py, this tree's) over each tree's `src` in the order of
# $TREES, then in reverse (A B C C B A), so every tree's rows come from the same machine and hour;
# then, optionally, GPU tests of the last tree under MPS. Usage, from the repository root:
#   mkdir -p .cache/before && git archive <commit> src | tar -x -C .cache/before   # here, with git
#   OUT=/some/dir TREES=".cache/before ." PEER_ARGS="--suite quant --budget-s 60" bash benchmarks/device/peer_ab.sh
# (the device call carries the .cache trees). Each tree is a directory holding `src`; "." is this
# tree. Rows of every run go to $OUT/peer_ab.jsonl with extra.tree (the directory), extra.run_order;
# $OUT/peer_ab.txt is the table of medians, a column per run; logs return as $OUT/logs.tgz.
# PEER_LIMIT: seconds per run (default 150); TESTS / TEST_LIMIT: pytest arguments and limit (0 or
# unset TESTS: no tests).
set -o pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tpfuse-triton-cache}"
OUT="${OUT:-$PWD/peer_ab_out}"
read -r -a trees <<< "${TREES:?TREES must name the trees to compare, e.g. TREES=\".cache/before .\"}"
for t in "${trees[@]}"; do
  [ -d "$t/src/tpfuse" ] || { echo "peer_ab: $t/src/tpfuse not found (export one with git archive, see the usage)" >&2; exit 2; }
done
rm -rf /tmp/peer_ab_logs
mkdir -p "$OUT" /tmp/peer_ab_logs "$TRITON_CACHE_DIR"
: > "$OUT/peer_ab.jsonl"
started=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee /tmp/peer_ab_logs/gpu.txt
order=("${trees[@]}")
for ((i = ${#trees[@]} - 1; i >= 0; i--)); do order+=("${trees[i]}"); done
run=0
for t in "${order[@]}"; do
  run=$((run + 1))
  src=$(cd "$t/src" && pwd)
  echo "=== run $run: $t (at $((SECONDS - started))s)"
  PYTHONPATH="$src" timeout "${PEER_LIMIT:-150}" python3 benchmarks/bench_peer_kernels.py \
    --out "/tmp/peer_ab_logs/run$run.jsonl" ${PEER_ARGS:---suite quant --budget-s 60} > "/tmp/peer_ab_logs/run$run.log" 2>&1
  echo "=== run $run: exit $? after $((SECONDS - started))s"
  python3 - "$t" "$run" "/tmp/peer_ab_logs/run$run.jsonl" "$OUT/peer_ab.jsonl" <<'EOF'
import json, pathlib, sys
tree, run, src, dst = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]), pathlib.Path(sys.argv[4])
rows = [json.loads(line) for line in src.read_text().splitlines()] if src.exists() else []
with dst.open("a") as f:
    for r in rows:
        r["extra"].update(tree=tree, run_order=run)
        f.write(json.dumps(r, sort_keys=True, allow_nan=False) + "\n")
print(f"run {run} ({tree}): {len(rows)} rows")
EOF
done
python3 - "$OUT/peer_ab.jsonl" <<'EOF' | tee "$OUT/peer_ab.txt"
import json, pathlib, sys
rows = [json.loads(line) for line in pathlib.Path(sys.argv[1]).read_text().splitlines()]
runs = sorted({r["extra"]["run_order"]: r["extra"]["tree"] for r in rows}.items())
table, bad = {}, 0
for r in rows:
    if not r["op"].startswith("all_reduce"):
        continue
    e = r["extra"]
    quant = e.get("quant", "-") + ("/2k" if e.get("path") == "two_kernels" else "")
    key = (r["strategy"], r["world_size"], r["shape"]["tokens"], quant, e.get("suite_case", ""))
    table.setdefault(key, {})[e["run_order"]] = r["median"]
    bad += not e.get("valid")
print("runs: " + ", ".join(f"{k}={t}" for k, t in runs) + f"; rows not valid: {bad}")
print(f"{'strategy':18} {'W':>2} {'tok':>4} {'quant (/2k: two kernels)':25} " + " ".join(f"{k:>7}" for k, _ in runs))
for key, med in table.items():
    cells = " ".join(f"{med[k]:7.2f}" if med.get(k) is not None else f"{'-':>7}" for k, _ in runs)
    print(f"{key[0]:18} {key[1]:>2} {key[2]:>4} {key[3]:25} {cells}")
EOF
if [ -n "${TESTS:-}" ] && [ "${TEST_LIMIT:-240}" != "0" ]; then
  nvidia-cuda-mps-control -d && echo "MPS on"
  last=$(cd "${trees[-1]}/src" && pwd)
  echo "=== gpu tests of ${trees[-1]} (at $((SECONDS - started))s)"
  PYTHONPATH="$last" timeout "${TEST_LIMIT:-240}" bash -c "python3 -m pytest -q -rs -p no:cacheprovider $TESTS \
    > $OUT/gpu_tests.txt 2>&1"
  echo "=== gpu tests: exit $? after $((SECONDS - started))s"
  echo quit | nvidia-cuda-mps-control
  tail -3 "$OUT/gpu_tests.txt"; grep -E "FAILED|Error" "$OUT/gpu_tests.txt" | head -20
fi
tar czf "$OUT/logs.tgz" -C /tmp/peer_ab_logs .
