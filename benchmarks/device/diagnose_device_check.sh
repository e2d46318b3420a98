#!/usr/bin/env bash
# One device call: `tpfuse diagnose` over diagnose_workload.py (matmul, spin, idle phases) with
# --json, --png and --save; per-phase power/limit rows; the diagnose gpu tests; the table again
# from the saved recording. Everything lands in $OUT (default ./diagnose_out).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=200
OUT="${OUT:-$PWD/diagnose_out}"
mkdir -p "$OUT"
FG="python3 -m tpfuse.cli"
$FG diagnose --help >/dev/null 2>&1 || { echo "tpfuse CLI does not load (another subcommand broken?); using diagnose alone";
  FG="python3 -c 'import sys; from tpfuse.cli import main as m; m.COMMANDS = (\"diagnose\",); sys.exit(m.main(sys.argv[1:]))'"; }
nvidia-smi --query-gpu=name,power.limit,power.draw,clocks.sm,clocks.max.sm --format=csv
eval "$FG diagnose --json --png $OUT/diagnose.png --save $OUT/samples.json -- python3 benchmarks/device/diagnose_workload.py --phases $OUT/phases.json" \
  >"$OUT/diagnose.json" 2>"$OUT/diagnose.err"
echo "diagnose exit code: $?"
cat "$OUT/diagnose.err"
python3 - "$OUT/diagnose.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("json keys:", sorted(d))
for g in d["gpus"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in g.items()})
for f in d["findings"]:
    print(f["severity"], f["kind"], f["message"])
print("notes:", d["notes"], "tick_ms_median:", d["tick_ms_median"], "png:", d["png"])
PY
head -c 8 "$OUT/diagnose.png" | od -c | head -1
python3 benchmarks/device/diagnose_phases.py "$OUT/samples.json" "$OUT/phases.json" --out "$OUT/diagnose.jsonl"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/diagnose tests/cli/test_diagnose.py 2>&1 | tail -5
eval "$FG diagnose --from $OUT/samples.json"
