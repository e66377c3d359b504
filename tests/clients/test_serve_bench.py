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
                        "--baseline-requests", "1", "2", "--baseline-max-output", "5",
                        "--phase-timeout", "60", "--results-dir", str(tmp_path)])
    (path,) = tmp_path.glob("serving-*.json")
    result = json.loads(path.read_text())
    phases = result["runs"]["hf_paged"]["phases"]
    # W1's phases, then those stock transformers serve would run too: its first 1 and 2
    # requests at once, cut to 5 new tokens
    assert [p.get("rate_requests_per_s", p.get("concurrency")) for p in phases] == [16, 2, 1, 2]
    for count, phase in zip((1, 2), phases[2:]):
        assert phase["baseline_requests"] == count and phase["baseline_max_output"] == 5
        assert phase["completed"] == count, phase
        # Five tokens may reach a lagging client in one chunk (the server joins a stream's
        # pending text), which leaves no time between tokens to count: none, never a zero.
        assert phase["tpot_ms_p50"] is None or phase["tpot_ms_p50"] > 0, phase
    for phase in phases[:2]:
        assert phase["completed"] == 4 and not phase["timed_out"], phase
        assert phase["output_tok_per_s"] > 0 and phase["tpot_ms_p50"] > 0, phase
        assert phase["server_metrics"]["hf_paged_preemptions_total"] == 0, phase
        assert len(phase["client_processes"]) == 2, phase
    text = serving_report.report(tmp_path)
    assert "| 16 req/s |" in text and "| 2 clients (closed loop) |" in text, text
    assert "| first 2 requests at once, 5 tokens at most |" in text, text
    assert [serving_report._panel(p) for p in phases] == [
        "rate_requests_per_s", "concurrency", "baseline_requests", "baseline_requests"]


def test_fake_steps_generate_text_tokens_at_the_step_time(tiny_checkpoint, tokenizer):
    """The serving overhead benchmark's engine (``profile_serving --fake-step-ms``): the real
    host side, no model; each sampled token the next text token in turn; a step's time."""
    import time

    from benchmarks import fake_steps
    from hf_paged import SamplingParams
    from hf_paged.generation.paged_engine import PagedEngine
    from tests.conftest import SMALL

    tokens = fake_steps.text_tokens(tokenizer)
    assert tokens and all(tokenizer.decode([t]).strip() for t in tokens[:50])
    uninstall = fake_steps.install(20.0, tokens[:5])
    try:
        engine = PagedEngine.from_pretrained(tiny_checkpoint, device="cpu", **SMALL)
    finally:
        uninstall()
    assert "from_pretrained" not in vars(PagedEngine)
    with engine:
        start = time.perf_counter()
        out = engine.generate_tokens([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4))
        took = time.perf_counter() - start
    assert sorted(t for row in out for t in row) == sorted((tokens[:5] * 2)[:8])
    assert took >= 4 * 0.020  # four steps at least
