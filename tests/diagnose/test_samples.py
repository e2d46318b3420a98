"""The recording file format: exact round trip, forward-compatible reads, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tpfuse.diagnose.samples import (
    FORMAT,
    SAMPLE_FIELDS,
    Recording,
    Sample,
    load_recording,
    recording_from_dict,
    recording_to_dict,
    save_recording,
)

from .synth import BUSY, WAITING, make_recording


def test_round_trip_is_exact(tmp_path):
    rec = make_recording({0: [(BUSY, 25)], 3: [(WAITING, 25)]}, seed=21)
    rec = dataclasses.replace(rec, mode="command", command=("python3", "x.py"), exit_code=3, interrupted=True,
                              tick_ms_median=0.41, notes=("NVML could not read processes: Not Supported",))
    # a None reading must survive too
    rec = dataclasses.replace(rec, samples=rec.samples[:-1] + (dataclasses.replace(rec.samples[-1], power_w=None),))
    path = save_recording(rec, tmp_path / "sub" / "rec.json")
    back = load_recording(path)
    assert back == rec
    assert back.samples[-1].power_w is None


def test_non_finite_readings_are_stored_as_unknown():
    s = Sample(t_s=0.5, gpu=0, power_w=math.nan, power_limit_w=700.0, util_pct=math.inf, mem_util_pct=1.0,
               sm_clock_mhz=1.0, mem_clock_mhz=1.0, mem_used_bytes=1)
    rec = Recording(gpus=(), samples=(s,), interval_s=0.1, mode="duration")
    text = json.dumps(recording_to_dict(rec), allow_nan=False)  # raises if a NaN leaked through
    back = recording_from_dict(json.loads(text))
    assert back.samples[0].power_w is None and back.samples[0].util_pct is None
    assert back.samples[0].power_limit_w == 700.0


def test_reader_accepts_reordered_and_extra_fields():
    rec = make_recording({0: [(BUSY, 5)]}, seed=22)
    data = recording_to_dict(rec)
    order = list(reversed(data["fields"])) + ["future_field"]
    idx = [data["fields"].index(n) for n in order[:-1]]
    data["rows"] = [[row[i] for i in idx] + [123] for row in data["rows"]]
    data["fields"] = order
    data["future_key"] = {"ignored": True}
    assert recording_from_dict(data) == rec


@pytest.mark.parametrize("content, match", [
    ("not json", "is not JSON"),
    ('{"format": "something else"}', "not a tpfuse diagnose recording"),
    (json.dumps({"format": FORMAT, "version": 99}), "version 99"),
    (json.dumps({"format": FORMAT, "version": 1, "fields": ["t_s"], "rows": [], "gpus": []}), "lacks sample fields"),
    (json.dumps({"format": FORMAT, "version": 1, "fields": list(SAMPLE_FIELDS)}), "malformed"),
])
def test_bad_files_raise_value_error_with_the_fix(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_recording(path)
    message = str(info.value)
    assert message.startswith(f"load_recording: {path}")
    assert "--save" in message or "re-record" in message


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read .*nope.json"):
        load_recording(tmp_path / "nope.json")
