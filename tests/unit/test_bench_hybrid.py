"""The hybrid benchmark end to end on CPU with a tiny Qwen3.5 checkpoint (it runs for real on a
GPU, where a script that breaks wastes scarce device time), and the real Qwen3.5 shapes it is
run on there."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import bench_hybrid, report
from benchmarks.floor import MemoryCost
from hf_paged.random_checkpoint import make_checkpoint, shape_config

TINY_RUN = ["--device", "cpu", "--dtype", "float32", "--num-requests", "4",
            "--max-input-len", "32", "--max-output-len", "8", "--baseline-requests", "2",
            "--batch-size", "2", "--baseline-max-output", "4", "--repeats", "1",
            "--prompt-len", "16", "--new-tokens", "4", "--ttft-prompt-len", "32",
            "--baseline-new-tokens", "2", "--w3-requests", "4", "--w3-prefix-len", "48",
            "--w3-new-tokens", "4", "--snapshots", "4", "-E", "block_size=16"]


@pytest.mark.parametrize("shape", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_every_part_against_its_floor_and_stock(shape, tmp_path):
    """W1, batch 1 and W3 on and off: every line a figure, the stock baseline on W1's first
    requests with their outputs cut, and W3's prefix cache hit through the state snapshots."""
    path = make_checkpoint(shape, str(tmp_path / "ckpt"), dtype="float32")
    bench_hybrid.main(["--model", path, *TINY_RUN, "--tag", shape,
                       "--results-dir", str(tmp_path)])
    data = json.loads((tmp_path / f"hybrid-{shape}-cpu.json").read_text())
    assert data["complete"]
    paged = data["hf_paged"]
    assert not [label for label, fig in paged.items() if "error" in fig]
    assert set(paged) == {"w1", "hf_paged@baseline_requests", "batch1",
                          *bench_hybrid.W3_LINES}
    assert paged["w1"]["output_tokens"] == data["workload_description"]["w1"]["output_tokens"]
    assert paged["hf_paged@baseline_requests"]["output_tokens"] == 2 * 4
    stock = data["baselines"]["transformers_generate"]
    assert stock["w1"]["output_tokens"] == 2 * 4 and stock["batch1"]["decode_ms_per_token"] > 0
    assert stock["linear_attention_path"] == "transformers' torch fallbacks"  # none installed
    cost = MemoryCost.from_checkpoint(path, torch.float32)
    assert data["floor"]["state_bytes_per_sequence_step"] == cost.state_bytes_per_seq > 0
    on, off = (paged[label] for label in bench_hybrid.W3_LINES)
    assert on["engine_config"]["num_state_snapshots"] == 4
    assert on["last_run_counters"]["prefix_cache_hits"] > 0
    assert off["last_run_counters"]["prefix_cache_hits"] == 0
    assert on["floor_s"] < off["floor_s"]  # the prefix's KV read once a step
    assert data["prefix_caching_speedup"] == pytest.approx(
        on["output_tokens_per_s"] / off["output_tokens_per_s"])
    assert [row["metric"] for row in data["summary"]] == [
        "W1 output tok/s", "decode ms/token, batch 1", "W3 output tok/s, prefix caching on",
        "W3 output tok/s, prefix caching off"]
    assert "| hybrid (" + shape + ") | cpu |" in report.table(report.load(tmp_path))


def test_a_model_without_linear_layers_is_refused(tmp_path):
    path = make_checkpoint("tiny", str(tmp_path), dtype="float32")
    with pytest.raises(SystemExit, match="not a hybrid model"):
        bench_hybrid.main(["--model", path, "--device", "cpu", "--results-dir", str(tmp_path)])


def parameters(shape: str) -> tuple[float, float]:
    """The text model's parameters and those one token reads (8 of 256 experts), billions."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape, "bfloat16"))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    config = model.config
    share = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_experts", 1)
    return total / 1e9, (total - experts * (1 - share)) / 1e9


def test_the_qwen3_5_shapes_have_their_releases_sizes():
    """The text models of Qwen3.5-9B (its vision tower makes up the rest of the name) and of
    Qwen3.5-35B-A3B (35B in all, about 3B a token), three Gated DeltaNet layers a full one."""
    total, _ = parameters("qwen3.5-9b")
    assert 8.9 < total < 9.0
    total, active = parameters("qwen3.5-35b-a3b")
    assert 34.5 < total < 35 and 3.0 < active < 3.5
    for shape in ("qwen3.5-9b", "qwen3.5-35b-a3b"):
        types = shape_config(shape, layers=8).layer_types
        assert types == (["linear_attention"] * 3 + ["full_attention"]) * 2
