"""Cut a `tpfuse diagnose --save` recording into the phases logged by diagnose_workload.py and
record, per phase, the power as a fraction of the enforced limit and the utilisation NVML reported.

These are the readings the analysis thresholds are judged against (tpfuse.diagnose.analysis):
dense GEMMs should sit far above WAIT_POWER_FRACTION, the spinning kernel below it at ~100%
utilisation, the idle phase near 0% utilisation. Usage:

    python3 benchmarks/device/diagnose_phases.py samples.json phases.json --out benchmarks/results/diagnose.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

from tpfuse.diagnose.samples import load_recording
from tpfuse.results import append_rows, make_row

# NVML's power on Ampere and newer is a 1 s moving average (NVML API reference), and utilisation
# covers a window of up to 1 s: samples in the first second of a phase still carry the previous one.
TRIM_S = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples")
    ap.add_argument("phases")
    ap.add_argument("--out", required=True, help="results file (JSON lines) to append rows to")
    ap.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU the workload ran on")
    args = ap.parse_args()
    rec = load_recording(args.samples)
    log = json.loads(open(args.phases).read())
    rows = []
    print(f"{'phase':8s} {'samples':>7s} {'power/limit p20 / median / p80':>32s} {'util median %':>14s} {'SM MHz':>7s}")
    for phase in log["phases"]:
        lo = phase["start_unix"] - rec.started_unix + TRIM_S
        hi = phase["end_unix"] - rec.started_unix
        inside = [s for s in rec.samples_of(args.gpu) if lo <= s.t_s <= hi and s.power_fraction is not None]
        if len(inside) < 3:
            print(f"{phase['name']:8s} only {len(inside)} samples after trimming {TRIM_S} s; skipped")
            continue
        fracs = [s.power_fraction for s in inside]
        util = statistics.median(s.util_pct for s in inside if s.util_pct is not None)
        clock = statistics.median(s.sm_clock_mhz for s in inside if s.sm_clock_mhz is not None)
        row = make_row("nvml_power_fraction", phase["name"],
                       {"gemm_n": log["gemm_n"], "spin_cycles": log["spin_cycles"]},
                       "bfloat16", 1, fracs, "fraction_of_enforced_power_limit",
                       util_median_pct=util, sm_clock_median_mhz=clock, power_limit_w=inside[0].power_limit_w,
                       num_samples=len(inside), trim_s=TRIM_S, interval_s=rec.interval_s,
                       tick_ms_median=rec.tick_ms_median, driver=rec.driver, nvml_gpu=log["gpu"])
        rows.append(row)
        print(f"{phase['name']:8s} {len(inside):7d} {row.p20:10.3f} / {row.median:6.3f} / {row.p80:6.3f} "
              f"{util:14.0f} {clock:7.0f}")
    append_rows(args.out, rows)
    print(f"{len(rows)} rows appended to {args.out}")


if __name__ == "__main__":
    main()
