"""The benchmark scripts end to end on CPU, with a tiny checkpoint and tiny workloads: they
run for real on a GPU, where a script that breaks wastes scarce device time."""

from __future__ import annotations

import json

import pytest
import torch

import hf_paged
from benchmarks import (
    bench_latency,
    bench_lora,
    bench_quantized,
    bench_speculation,
    bench_startup,
    bench_throughput,
    common,
    report,
    w1_split,
)
from benchmarks.floor import MemoryCost
from benchmarks.fp8_checkpoint import quantize_checkpoint
from benchmarks.workloads import w2_decode
from hf_paged.config import EngineConfig
from hf_paged.random_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    path = make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")), dtype="float32")
    return ["--model", path, "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> list[str]:
    path = make_checkpoint("tiny-moe", str(tmp_path_factory.mktemp("moe")), dtype="float32")
    return ["--model", path, "--device", "cpu", "--dtype", "float32", "--tag", "tiny-moe"]


def metrics(path) -> list[str]:
    data = json.loads(path.read_text())
    assert data["complete"], data
    return [row["metric"] for row in data["summary"]]


def test_latency_with_a_baseline(tiny, tmp_path):
    bench_latency.main([*tiny, "--repeats", "1", "--new-tokens", "4", "--ttft-prompt-len", "32",
                        "--results-dir", str(tmp_path), "--baselines", "generate"])
    assert metrics(tmp_path / "w2-cpu.json") == [
        "decode ms/token, batch 1", "time to first token ms, 32-token prompt",
        "time to first streamed token ms, 32-token prompt"]


def test_latency_per_tensor_parallel_size(tiny, tmp_path):
    bench_latency.main([*tiny, "--workload", "w4", "--tensor-parallel-size", "1", "2",
                        "--repeats", "1", "--new-tokens", "4", "--ttft-prompt-len", "32",
                        "--results-dir", str(tmp_path), "--baselines"])
    names = metrics(tmp_path / "w4-batch1-cpu.json")
    assert len(names) == 6 and names[3].endswith("tensor parallel size 2")


def test_throughput_with_a_baseline(tiny, tmp_path):
    bench_throughput.main([*tiny, "--num-requests", "4", "--max-input-len", "32",
                           "--max-output-len", "8", "--baseline-requests", "2",
                           "--results-dir", str(tmp_path), "--baselines", "generate"])
    data = json.loads((tmp_path / "w1-cpu.json").read_text())
    assert data["complete"] and data["baselines"]["transformers_generate"]["output_tokens_per_s"]
    assert metrics(tmp_path / "w1-cpu.json")[:2] == ["output tok/s", "output tok/s, greedy"]


def test_startup_fresh_and_warm(tiny, tmp_path):
    bench_startup.main([*tiny, "--warm-starts", "1", "--results-dir", str(tmp_path)])
    assert metrics(tmp_path / "startup-cpu.json") == [
        "start-up s, fresh caches", "start-up s, warm caches"]


def test_results_are_copied_to_out_and_name_the_given_commit(tmp_path, monkeypatch):
    """A run on a copied tree can name its commit; $OUT may be the results directory itself."""
    monkeypatch.setenv("BENCH_GIT_COMMIT", "abc123")
    assert common.git_commit() == "abc123"
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    common.write_result(tmp_path / "results" / "w1-cpu.json", {"figure": 1})
    assert json.loads((out / "w1-cpu.json").read_text()) == {"figure": 1}
    common.write_result(out / "w2-cpu.json", {"figure": 2})  # no copy onto itself
    assert json.loads((out / "w2-cpu.json").read_text()) == {"figure": 2}


def test_tagged_moe_throughput_reuses_its_own_baselines(tiny_moe, tmp_path):
    """A tagged run keeps a file of its own, finds its baselines there with ``auto``, and the
    report names its shape; ``--extra-lines`` with no value runs the main line alone."""
    run = [*tiny_moe, "--num-requests", "4", "--max-input-len", "32", "--max-output-len", "8",
           "--baseline-requests", "2", "--results-dir", str(tmp_path), "--extra-lines"]
    bench_throughput.main([*run, "--baselines", "generate"])
    path = tmp_path / "w1-tiny-moe-cpu.json"
    first = json.loads(path.read_text())
    assert first["tag"] == "tiny-moe" and first["floor"]["experts"] == 8
    assert list(first["hf_paged"]) == ["hf_paged", bench_throughput.SAME_REQUESTS]
    bench_throughput.main([*run, "--reuse-baselines", "auto"])
    again = json.loads(path.read_text())
    assert again["baselines_reused_from"] == str(path)
    assert again["baselines"] == first["baselines"]
    assert [p.name for p in tmp_path.glob("*.json")] == [path.name]
    assert "| w1 (tiny-moe) | cpu (baselines reused) | output tok/s |" in report.table(
        report.load(tmp_path))


def test_moe_batch1_floor_reads_k_experts(tiny_moe, tmp_path):
    bench_latency.main([*tiny_moe, "--repeats", "1", "--new-tokens", "4", "--prompt-len", "16",
                        "--ttft-prompt-len", "32", "--bandwidth", "1e9",
                        "--results-dir", str(tmp_path), "--baselines"])
    data = json.loads((tmp_path / "w2-tiny-moe-cpu.json").read_text())
    cost = MemoryCost.from_checkpoint(tiny_moe[1], torch.float32)
    # 4 steps of the dense weights and 2 of 8 experts in each of 2 layers; KV of 16..19 tokens.
    step = cost.dense_bytes + 2 * 2 * cost.experts.bytes_per_expert
    kv = (16 + 17 + 18 + 19) * cost.kv_bytes_per_token
    assert data["summary"][0]["floor"] == pytest.approx((4 * step + kv) / 1e9 * 1e3 / 4)
    assert cost.floor_bytes(w2_decode(1, 16, 4)) == pytest.approx(4 * step + kv)


def test_speculation_end_to_end(tiny, tmp_path):
    """Every line on tiny target and draft checkpoints (W1's on the tiny checkpoint): no line
    fails, every output is plain greedy's and the permutation's, and the acceptance is the
    one built in."""
    bench_speculation.main([
        *tiny, "--checkpoints", str(tmp_path / "ckpt"), "--target-shape", "tiny",
        "--draft-shape", "tiny", "--changed", "0", "0.5", "--stock-changed", "0.5",
        "--cycle-len", "4", "--long-cycle-len", "256", "--prompt-len", "12",
        "--new-tokens", "8", "--repeats", "1", "--stock-new-tokens", "4", "--stock-repeats", "1",
        "--w1-num-requests", "2", "--w1-max-input-len", "16", "--w1-max-output-len", "4",
        "--results-dir", str(tmp_path)])
    data = json.loads((tmp_path / "speculation-cpu.json").read_text())
    lines = {**data["hf_paged"], **data["baselines"]}
    assert not [label for label, fig in lines.items() if "error" in fig]
    batch1 = {label: fig for label, fig in lines.items() if not label.startswith("w1")}
    assert all(fig["follows_permutation"] for fig in batch1.values())
    assert all(fig["matches_plain"] for label, fig in batch1.items()
               if not label.startswith("plain"))
    paged = data["hf_paged"]
    for label in ("draft_tiny_f0", "self_draft", "prompt_lookup_repeating"):
        assert paged[label]["acceptance"] == 1.0 and paged[label]["speedup_vs_plain"]
    assert paged["draft_tiny_f0.5"]["acceptance"] < 1.0
    assert paged["prompt_lookup_random"]["num_accepted_tokens"] == 0
    assert metrics(tmp_path / "speculation-cpu.json") == [
        "output tok/s, W1", "output tok/s, W1 + ngram speculation", "batch-1 tok/s, plain",
        "batch-1 tok/s, plain, repeating prompts", "batch-1 tok/s, tiny draft, 100% agreement",
        "batch-1 tok/s, tiny draft, 50% agreement", "batch-1 tok/s, target as its own draft",
        "batch-1 tok/s, prompt lookup, repeating prompts",
        "batch-1 tok/s, prompt lookup, random prompts"]


def test_w1_split_groups_every_step(tiny, tmp_path):
    w1_split.main([*tiny, "--num-requests", "6", "--max-input-len", "24",
                   "--max-output-len", "12", "--results-dir", str(tmp_path)])
    data = json.loads((tmp_path / "w1-split-cpu.json").read_text())
    groups = data["groups"]
    assert "prefill" in groups and "decode_1+" in groups
    assert sum(g["tokens"] for g in groups.values()) >= data["output_tokens"]
    assert 0 < groups["decode_1+"]["fraction_of_floor"]
    assert sum(g["seconds"] for g in groups.values()) <= data["seconds"]


def test_quantized_weights_against_bf16(tiny, tmp_path):
    """W1 and batch 1 on a tiny checkpoint and its FP8 copy, each line against its own floor,
    transformers' generate on the FP8 copy beside the FP8 lines (dequantized on a CPU)."""
    fp8 = quantize_checkpoint(tiny[1], str(tmp_path / "fp8"))
    bench_quantized.main([
        *tiny, "--fp8-model", fp8, "--parts", "w1", "batch1", "--num-requests", "4",
        "--max-input-len", "32", "--max-output-len", "8", "--baseline-requests", "2",
        "--baseline-max-output-len", "3",
        "--batch-size", "2", "--repeats", "1", "--prompt-len", "16", "--new-tokens", "4",
        "--ttft-prompt-len", "32", "--baseline-new-tokens", "2", "--tag", "tiny",
        "--results-dir", str(tmp_path)])
    path = tmp_path / "quantized-tiny-cpu.json"
    assert metrics(path) == ["W1 output tok/s, bf16", "W1 output tok/s, FP8 weights",
                             "decode ms/token, batch 1, bf16",
                             "decode ms/token, batch 1, FP8 weights"]
    data = json.loads(path.read_text())
    floor = data["floor"]
    assert floor["fp8_weights"]["weight_bytes_per_step"] < floor["bf16"]["weight_bytes_per_step"]
    baseline = data["baselines"]["transformers_generate"]
    assert baseline["w1"]["baseline_path"] == baseline["batch1"]["baseline_path"] == (
        "dequantized on load (CPU)")
    assert baseline["output_tokens_per_s"] and baseline["decode_ms_per_token"]
    assert data["summary"][1]["speedup"]["transformers_generate"] > 0
    # the baseline's requests capped at 3 new tokens, hf_paged's line on them too
    assert data["hf_paged"]["w1_fp8_weights@baseline_requests"]["output_tokens"] == 6


@pytest.mark.skipif("kv_cache_dtype" not in EngineConfig.__dataclass_fields__,
                    reason="needs the engine's kv_cache_dtype option")
def test_quantized_kv_cache_against_bf16(tiny, tmp_path):
    """W1 with the FP8 KV cache beside the bf16 cache, and the caches' agreement."""
    bench_quantized.main([
        *tiny, "--parts", "kv", "--num-requests", "4", "--max-input-len", "32",
        "--max-output-len", "8", "--agreement-prompts", "2", "--agreement-tokens", "6",
        "--tag", "tiny", "--results-dir", str(tmp_path)])
    path = tmp_path / "quantized-tiny-cpu.json"
    assert metrics(path) == ["W1 output tok/s, bf16", "W1 output tok/s, FP8 KV cache"]
    data = json.loads(path.read_text())
    assert data["floor"]["fp8_kv"]["kv_bytes_per_token"] * 4 == (
        data["floor"]["bf16"]["kv_bytes_per_token"])
    agreement = data["kv_cache_agreement"]
    assert agreement["tokens"] == 12 and 0 <= agreement["top1_agreement"] <= 1
    assert agreement["kl_mean"] >= 0


def test_cache_agreement_of_logits():
    """Equal logits: no divergence, full agreement; a flipped top-1 shows in both."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]])
    same = bench_quantized.cache_agreement(logits, logits)
    assert same["kl_max"] == pytest.approx(0, abs=1e-6) and same["top1_agreement"] == 1.0
    other = logits.clone()
    other[1] = torch.tensor([1.0, 0.0, 0.5])
    moved = bench_quantized.cache_agreement(logits, other)
    assert moved["top1_agreement"] == 0.5 and moved["kl_max"] > 0.1
    assert moved["kl_mean"] == pytest.approx(moved["kl_max"] / 2, rel=1e-5)


def test_cache_agreement_forces_the_second_run_onto_the_first(tiny, monkeypatch):
    """With the same cache twice, the forced second run reproduces the first's logits."""
    monkeypatch.setattr(bench_quantized, "KV_FP8", {})
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    result = bench_quantized.agreement(tiny[1], torch.float32, torch.device("cpu"), prompts, 5,
                                       {})
    assert result["tokens"] == 10 and result["top1_agreement"] == 1.0
    assert result["kl_max"] == pytest.approx(0, abs=1e-5)
    # The forcing itself: the engine emits the given tokens, whatever its logits say.
    forced = torch.randint(0, 1000, (2, 5))
    engine = hf_paged.from_pretrained(tiny[1], dtype=torch.float32, device="cpu")
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    out = engine.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=5,
                          eos_token_id=None, pad_token_id=0,
                          logits_processor=[bench_quantized.ForceTokens(forced, 5)])
    engine.close()
    assert torch.equal(out[:, 5:], forced)


def test_lora_adapters_against_the_base(tiny, tmp_path):
    """W1 on the base model and on 1 and 2 peft-saved adapters, batch 1 without and with one,
    transformers + peft beside the one-adapter lines; each line's floor counts its adapters."""
    bench_lora.main([
        *tiny, "--adapters", "1", "2", "--adapters-dir", str(tmp_path / "adapters"),
        "--num-requests", "4", "--max-input-len", "32", "--max-output-len", "8",
        "--baseline-requests", "2", "--batch-size", "2", "--repeats", "1", "--prompt-len", "16",
        "--new-tokens", "4", "--baseline-new-tokens", "2", "--bandwidth", "1e9",
        "--tag", "tiny", "--results-dir", str(tmp_path)])
    path = tmp_path / "lora-tiny-cpu.json"
    assert metrics(path) == [
        "W1 output tok/s, base model", "W1 output tok/s, 1 adapter", "W1 output tok/s, 2 adapters",
        "W1 tok/s with 1 adapter over the base model's",
        "W1 tok/s with 2 adapters over the base model's",
        "decode ms/token, batch 1, base model", "decode ms/token, batch 1, 1 adapter"]
    data = json.loads(path.read_text())
    assert data["device"]["peft"] and data["device"]["count"] == 1
    assert (tmp_path / "adapters" / "adapter1").is_dir()
    paged, each = data["hf_paged"], data["floor"]["adapter_bytes"]
    assert [paged[f"w1_{n}"]["stats"]["num_loras"] for n in (0, 1, 2)] == [0, 1, 2]
    # 4 requests of 8 new tokens (W1's lengths clipped to 8): every adapter read at 8 steps
    for n in (1, 2):
        floor = paged[f"w1_{n}"]["floor_s"] - paged["w1_0"]["floor_s"]
        assert floor == pytest.approx(8 * n * each / 1e9)
    batch1 = [paged[f"batch1_{n}"]["floor_ms_per_token"] for n in (0, 1)]
    assert batch1[1] - batch1[0] == pytest.approx(each / 1e9 * 1e3)
    baseline = data["baselines"]["transformers_generate"]
    assert baseline["output_tokens_per_s"] and baseline["decode_ms_per_token"]
    assert data["summary"][1]["speedup"]["transformers_generate"] > 0
    assert "| lora (tiny) | cpu | W1 output tok/s, 2 adapters |" in report.table(
        report.load(tmp_path))


def test_data_parallel_weak_scaling_gives_each_replica_a_whole_workload(tiny, tmp_path):
    """``--weak-scaling``: two replicas run twice the requests, and the scaling is reported."""
    bench_throughput.main([*tiny, "--num-requests", "3", "--max-input-len", "16",
                           "--max-output-len", "4", "--data-parallel-size", "1", "2",
                           "--weak-scaling", "--extra-lines", "--results-dir", str(tmp_path),
                           "--baselines"])
    data = json.loads((tmp_path / "w1-cpu.json").read_text())
    runs = data["hf_paged"]
    assert [runs[f"data_parallel_size_{n}"]["num_requests"] for n in (1, 2)] == [3, 6]
    assert data["workload_description"]["weak_scaling"]
    assert set(data["data_parallel_scaling"]) == {"data_parallel_size_1", "data_parallel_size_2"}
