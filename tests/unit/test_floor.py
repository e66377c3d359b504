"""The memory-traffic floor: a dense checkpoint's steps read every weight, a mixture of
experts' steps the dense weights and the experts their tokens are expected to route to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.floor import (
    FLOOR_MODEL,
    HYBRID_FLOOR_MODEL,
    MOE_FLOOR_MODEL,
    AdapterCost,
    Experts,
    MemoryCost,
    floor_settings,
)
from benchmarks.fp8_checkpoint import quantize_checkpoint
from benchmarks.workloads import Workload
from hf_paged.random_checkpoint import make_checkpoint, random_qwen3, shape_config

CPU = torch.device("cpu")
# Two requests starting together: 2 generate at step 1, 1 at steps 2 and 3; the KV read is
# 4 tokens for the first, 3 + 4 + 5 for the second.
WORK = Workload([[1, 2, 3, 4], [5, 6, 7]], [1, 3])
KV_TOKENS = 4 + 3 + 4 + 5


def parameter_bytes(path: str) -> int:
    """Every float32 parameter once (a tied LM head is the embedding), counted by transformers
    rather than from the checkpoint's tensor names."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return 4 * sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")), dtype="float32")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return make_checkpoint("tiny-moe", str(tmp_path_factory.mktemp("moe")), dtype="float32")


def test_dense_steps_read_every_weight(tiny):
    cost = MemoryCost.from_checkpoint(tiny, torch.float32)
    assert cost.experts is None and cost.dense_bytes == parameter_bytes(tiny)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head_dim
    fp8 = MemoryCost.from_checkpoint(tiny, torch.float32, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 2 * 2 * 2 * 16  # one byte an element
    assert cost.weight_bytes(1) == cost.weight_bytes(256) == cost.dense_bytes
    floor = cost.floor_bytes(WORK)
    assert isinstance(floor, int)  # S*W exactly, as before experts were counted
    assert floor == 3 * cost.dense_bytes + KV_TOKENS * cost.kv_bytes_per_token
    settings = floor_settings(CPU, 1e9, cost)
    assert settings["floor_model"] == FLOOR_MODEL
    assert settings["weight_bytes_per_step"] == cost.dense_bytes


def test_each_distinct_adapter_is_read_once_a_step():
    """Requests of 1, 3, 2 and 5 steps: on one adapter it is read at all 5 steps; on two
    (requests 0 and 2 on the first, 1 and 3 on the second) the first at steps 1-2 and the
    second at 1-5; on four, each for its request's steps."""
    work = Workload([[1]] * 4, [1, 3, 2, 5])
    base = MemoryCost(dense_bytes=1000, kv_bytes_per_token=0)
    reads = {n: AdapterCost(base, 10, n).floor_bytes(work) - 5 * 1000 for n in (0, 1, 2, 4)}
    assert reads == {0: 0, 1: 5 * 10, 2: (2 + 5) * 10, 4: (1 + 3 + 2 + 5) * 10}


def test_moe_splits_dense_and_expert_bytes(tiny_moe):
    """tiny-moe: 2 sparse layers of 8 experts, 2 a token, each expert gate + up + down of
    32 x 64 float32."""
    cost = MemoryCost.from_checkpoint(tiny_moe, torch.float32)
    expert = 3 * 32 * 64 * 4
    assert cost.experts == Experts(sparse_layers=2, experts=8, top_k=2, bytes_per_expert=expert)
    assert cost.dense_bytes == parameter_bytes(tiny_moe) - 2 * 8 * expert
    # Batch 1 reads k experts a sparse layer; a large batch reaches every expert.
    assert cost.weight_bytes(1) == pytest.approx(cost.dense_bytes + 2 * 2 * expert)
    assert cost.weight_bytes(1000) == pytest.approx(cost.dense_bytes + 2 * 8 * expert)
    reads = [cost.weight_bytes(b) for b in (1, 2, 4, 16, 64)]
    assert reads == sorted(set(reads))
    # Batch 2: 8 * (1 - (6/8)^2) = 3.5 experts a layer.
    assert cost.weight_bytes(2) == pytest.approx(cost.dense_bytes + 2 * 3.5 * expert)
    # Step 1 at batch 2, steps 2 and 3 at batch 1: 3 dense reads, 7 + 4 + 4 experts.
    assert cost.floor_bytes(WORK) == pytest.approx(
        3 * cost.dense_bytes + 15 * expert + KV_TOKENS * cost.kv_bytes_per_token)


def test_moe_floor_settings_record_the_experts(tiny_moe):
    cost = MemoryCost.from_checkpoint(tiny_moe, torch.float32)
    settings = floor_settings(CPU, 1e9, cost)
    assert settings["floor_model"] == FLOOR_MODEL + " " + MOE_FLOOR_MODEL
    assert "weight_bytes_per_step" not in settings  # it depends on the batch
    assert {k: settings[k] for k in ("dense_weight_bytes_per_step", "sparse_layers", "experts",
                                     "top_k", "bytes_per_expert")} == {
        "dense_weight_bytes_per_step": cost.dense_bytes, "sparse_layers": 2, "experts": 8,
        "top_k": 2, "bytes_per_expert": 3 * 32 * 64 * 4}


def test_mlp_only_and_skipped_layers_count_as_dense(tmp_path):
    """Of 4 layers, decoder_sparse_step 2 makes layers 1 and 3 sparse and mlp_only_layers
    takes 3 back: one sparse layer, three dense MLPs read every step."""
    config = shape_config("tiny-moe", "float32", layers=4)
    config.decoder_sparse_step, config.mlp_only_layers = 2, [3]
    random_qwen3(config).save_pretrained(tmp_path)
    cost = MemoryCost.from_checkpoint(str(tmp_path), torch.float32)
    expert = 3 * 32 * 64 * 4
    assert cost.experts == Experts(sparse_layers=1, experts=8, top_k=2, bytes_per_expert=expert)
    assert cost.dense_bytes == parameter_bytes(str(tmp_path)) - 8 * expert  # the MLPs in it
    assert cost.weight_bytes(1) == pytest.approx(cost.dense_bytes + 2 * expert)


def test_experts_where_the_config_has_none_are_refused(tmp_path):
    """A checkpoint whose expert tensors disagree with its config would be floored wrong."""
    path = make_checkpoint("tiny-moe", str(tmp_path), dtype="float32")
    config = json.loads((Path(path) / "config.json").read_text())
    config["mlp_only_layers"] = [0]
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"expert tensors in layers \[0, 1\]"):
        MemoryCost.from_checkpoint(path, torch.float32)


def test_fp8_weights_count_a_byte_and_their_scales_four(tmp_path):
    """An FP8 copy of tiny-moe: every projection (each expert's too) a byte an element plus
    one float32 scale (its 32 x 64 fits one 128 x 128 block), the rest in the serving dtype;
    an FP8 KV cache a byte an element."""
    path = make_checkpoint("tiny-moe", str(tmp_path / "bf16"), dtype="float32")
    fp8 = quantize_checkpoint(path, str(tmp_path / "fp8"))
    plain, cost = (MemoryCost.from_checkpoint(p, torch.float32) for p in (path, fp8))
    assert cost.experts == Experts(sparse_layers=2, experts=8, top_k=2,
                                   bytes_per_expert=3 * (32 * 64 + 4))
    attention = 2 * sum(rows * 64 for rows in (64, 32, 32)) + 2 * 64 * 64  # q, k, v, o
    assert cost.dense_bytes == plain.dense_bytes - attention * 3 + 2 * 4 * 4
    kv8 = MemoryCost.from_checkpoint(path, torch.float32, "fp8")
    assert kv8.kv_bytes_per_token * 4 == plain.kv_bytes_per_token == cost.kv_bytes_per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_steps_read_and_write_each_sequence_state(tmp_path, dtype):
    """tiny-qwen3.5: layers 0-2 Gated DeltaNet, layer 3 full attention. K: that one layer's
    K and V, 2 KV heads of 16. Each linear layer's state of a sequence: the recurrent state,
    4 value heads x 16 x 16 in float32, and the convolution's 2 * 2 * 16 + 4 * 16 = 128
    channels x kernel 4 in the served dtype; read and written at each of a request's steps."""
    path = make_checkpoint("tiny-qwen3.5", str(tmp_path), dtype="float32")
    cost = MemoryCost.from_checkpoint(path, dtype)
    size = dtype.itemsize
    assert cost.experts is None and cost.kv_bytes_per_token == 2 * 1 * 2 * 16 * size
    assert cost.state_bytes_per_seq == 2 * 3 * (4 * 16 * 16 * 4 + 128 * 4 * size)
    assert cost.state_bytes_per_seq == {4: 36864, 2: 30720}[size]
    # Outputs 1 and 3: four request steps, each reading and writing its state.
    assert cost.floor_bytes(WORK) == (3 * cost.dense_bytes + KV_TOKENS * cost.kv_bytes_per_token
                                      + 4 * cost.state_bytes_per_seq)
    # Prefix caching shares the prefix's KV, never a sequence's state.
    shared = Workload([[7, 8, 9, 1], [7, 8, 9, 2, 3]], [2, 2])
    saved = cost.floor_bytes(shared) - cost.floor_bytes(shared, prefix_caching=True)
    assert saved == 3 * (4 - 2) * cost.kv_bytes_per_token
    settings = floor_settings(CPU, 1e9, cost)
    assert settings["floor_model"] == FLOOR_MODEL + " " + HYBRID_FLOOR_MODEL
    assert settings["state_bytes_per_sequence_step"] == cost.state_bytes_per_seq


def test_hybrid_moe_counts_experts_beside_the_state(tmp_path):
    """tiny-qwen3.5-moe: all 4 layers sparse (8 experts of 32, 2 a token; the shared expert
    is dense), beside the hybrid KV and state of tiny-qwen3.5; the untied embedding is read as
    rows, not whole (the LM head is)."""
    path = make_checkpoint("tiny-qwen3.5-moe", str(tmp_path), dtype="float32")
    cost = MemoryCost.from_checkpoint(path, torch.float32)
    assert cost.experts == Experts(sparse_layers=4, experts=8, top_k=2,
                                   bytes_per_expert=3 * 32 * 64 * 4)
    assert cost.dense_bytes == parameter_bytes(path) - 4 * 8 * 3 * 32 * 64 * 4 - 1024 * 64 * 4
    assert cost.kv_bytes_per_token == 2 * 2 * 16 * 4 and cost.state_bytes_per_seq == 36864
    settings = floor_settings(CPU, 1e9, cost)
    assert settings["floor_model"] == " ".join(
        [FLOOR_MODEL, MOE_FLOOR_MODEL, HYBRID_FLOOR_MODEL])


def test_requests_are_dealt_to_replicas_as_the_engine_deals_them():
    """Heaviest first (prompt plus new tokens), each to the least-loaded replica so far: every
    request once, in the replica that a data-parallel run's floor charges it to."""
    workload = Workload([[1] * 10, [1] * 2, [1] * 7, [1] * 3], [5, 1, 4, 2])  # 15, 3, 11, 5
    first, second = workload.dealt(2)
    assert first == Workload([[1] * 10, [1] * 2], [5, 1])  # 15 + 3
    assert second == Workload([[1] * 7, [1] * 3], [4, 2])  # 11 + 5
    assert workload.dealt(1) == [workload]
    assert len(workload.dealt(8)) == 4  # no empty replica
