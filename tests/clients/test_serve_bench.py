"""The serving benchmark end to end on CPU (hf-paged serve only, a few short requests), and
its README rows from the result: it runs for real on a GPU, where a script that breaks wastes
scarce device time."""

from __future__ import annotations

import json

from benchmarks import bench_serving, serving_report


def test_bench_serving_and_its_report(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tmp_path / "tiny"
    model.symlink_to(tiny_checkpoint)
    bench_serving.main(["--model", str(model), "--num-requests", "4", "--rates", "16",
                        "--concurrency", "2", "--systems", "hf_paged", "--client-processes", "2",
                        "--max-input-len", "40", "--max-output-len", "12",
                        "--phase-timeout", "60", "--results-dir", str(tmp_path)])
    (path,) = tmp_path.glob("serving-*.json")
    result = json.loads(path.read_text())
    phases = result["runs"]["hf_paged"]["phases"]
    assert [p.get("rate_requests_per_s", p.get("concurrency")) for p in phases] == [16, 2]
    for phase in phases:
        assert phase["completed"] == 4 and not phase["timed_out"], phase
        assert phase["output_tok_per_s"] > 0 and phase["tpot_ms_p50"] > 0, phase
        assert phase["server_metrics"]["hf_paged_preemptions_total"] == 0, phase
    text = serving_report.report(tmp_path)
    assert "| 16 req/s |" in text and "| 2 clients (closed loop) |" in text, text
