#!/usr/bin/env bash
# Time to the first useful result on a fresh machine: the README's main set-up command in a new
# virtual environment with pip's cache off, each step timed, from the checkout this script is in.
#   bash benchmarks/device/time_to_first_result.sh        # prints one line of seconds per step
set -euo pipefail
cd "$(dirname "$0")/../.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_NO_CACHE_DIR=1
stamp() { date +%s.%N; }
t0=$(stamp); python -m venv "$work/venv"; source "$work/venv/bin/activate"
t1=$(stamp); pip install -q torch==2.13.0 2>/dev/null
t2=$(stamp); pip install -q . 2>/dev/null
t3=$(stamp); tpfuse selftest --world-size 2 > "$work/selftest.txt"
t4=$(stamp)
tail -1 "$work/selftest.txt"
python - "$t0" "$t1" "$t2" "$t3" "$t4" <<'PY'
import sys
t = [float(v) for v in sys.argv[1:]]
steps = ("venv", "torch", "pip install .", "selftest")
print(", ".join(f"{s} {b - a:.1f} s" for s, a, b in zip(steps, t, t[1:])) + f"; total {t[-1] - t[0]:.1f} s")
PY
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) core(s)"
