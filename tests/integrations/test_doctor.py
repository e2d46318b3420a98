"""The rows `tpfuse doctor` prints for each engine (`tpfuse.integrations.doctor`): enabled by
TPFUSE_ENGINES and the engine's plugin list, what a start would do under each TPFUSE_CALIBRATE, the
dispatch tables in the cache, and an engine that is not installed."""

from __future__ import annotations


def test_doctor_rows(monkeypatch, tmp_path):
    from tpfuse.integrations import doctor

    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPFUSE_CALIBRATE", raising=False)
    monkeypatch.setattr(doctor, "_version", lambda dist: {"sglang": "0.5.23"}.get(dist))
    monkeypatch.setattr(doctor, "_entry_point",
                        lambda group: "tpfuse.integrations.sglang:plugin" if group == "sglang.srt.plugins" else None)
    monkeypatch.setenv("TPFUSE_ENGINES", "sglang")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["enabled"] and rows["sglang"]["would"].startswith("it replaces the fused allreduce")
    assert rows["sglang"]["would"].endswith("; at start-up it calibrates the captured batch sizes the dispatch table "
                                            f"lacks, within 15 s, and saves them (0 dispatch table(s) in {tmp_path})")
    monkeypatch.setenv("TPFUSE_CALIBRATE", "0")
    (tmp_path / "dispatch-0123456789abcdef.json").write_text("{}")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].endswith("at start-up it does not calibrate (TPFUSE_CALIBRATE=0): the conservative "
                                            f"default serves sizes the table lacks (1 dispatch table(s) in {tmp_path})")
    monkeypatch.setenv("TPFUSE_CALIBRATE", "later")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].endswith("at start-up it stands down: TPFUSE_CALIBRATE='later': use 1 "
                                            "(on, 15 s), 0 (off) or a budget in seconds such as 30s")
    assert rows["vllm"]["installed"] is None and rows["vllm"]["would"] == "nothing: the engine is not installed here"
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={"SGLANG_PLUGINS": "other"})}
    assert not rows["sglang"]["enabled"] and "SGLANG_PLUGINS='other' does not list tpfuse" in rows["sglang"]["would"]
    monkeypatch.setenv("TPFUSE_ENGINES", "")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].startswith("nothing (inert); set TPFUSE_ENGINES=sglang to enable")
