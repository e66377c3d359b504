"""The scaling report over GPUs: the throughput lines measured at several data- or
tensor-parallel sizes, each against one GPU and the ideal N-fold; other lines left out."""

from __future__ import annotations

import json

from benchmarks import scaling_report

DEVICE = {"name": "Some GPU", "slug": "some-gpu"}


def entry(metric: str, tok: float, floor: float | None = None) -> dict:
    return {"metric": metric, "hf_paged": tok, "fraction_of_floor": floor}


def test_scaling_rows_and_what_they_leave_out(tmp_path):
    dp = {"device": DEVICE, "summary": [
        entry("output tok/s, data parallel size 1", 1000.0, 0.8),
        entry("output tok/s, data parallel size 2", 1900.0, 0.75),
        entry("output tok/s, data parallel size 4", 3000.0, 0.6)]}
    tp = {"device": DEVICE, "summary": [
        entry("output tok/s, tensor parallel size 1", 500.0),
        entry("output tok/s, tensor parallel size 2", 800.0),
        entry("decode ms/token, batch 1, tensor parallel size 2", 3.0)]}  # not a throughput
    lone = {"device": DEVICE, "summary": [entry("output tok/s, data parallel size 2", 5.0)]}
    for name, result in dict(dp=dp, tp=tp, lone=lone).items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "list.json").write_text("[]")  # not a result: skipped
    text = scaling_report.report(tmp_path)
    assert "| dp | output tok/s, data parallel | 2 | 1,900 | 1.90x | 95% | 75.0% |" in text
    assert "| dp | output tok/s, data parallel | 4 | 3,000 | 3.00x | 75% | 60.0% |" in text
    assert "| tp | output tok/s, tensor parallel | 2 | 800 | 1.60x | 80% | — |" in text
    assert "lone" not in text and "ms/token" not in text  # no one-GPU figure; not tok/s
