"""On a CUDA GPU, bf16, Qwen3-MoE with the Qwen3-30B-A3B layer shape (128 experts, top-8; four
layers, so the checkpoint is small): tokens equal to stock transformers until the first
near-tie and every token a greedy choice under transformers' own logits, through the fused MoE
kernels in CUDA graphs, eagerly, with chunked prefill and with preemption."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_paged.random_checkpoint import make_checkpoint
from tests.gpu.test_gpu_parity import (
    LENGTHS,
    check_parity,
    left_padded,
    load_transformers,
    run,
    transformers_generate,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("30b-a3b", str(tmp_path_factory.mktemp("qwen3-30b-a3b-4")),
                           dtype="bfloat16", layers=4, device="cuda")


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    return left_padded([torch.randint(0, 10000, (n,), generator=gen) for n in LENGTHS])


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = load_transformers(checkpoint)
    yield model
    del model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference(hf_model, batch):
    return transformers_generate(hf_model, batch)


@pytest.fixture(scope="module")
def graph_tokens(checkpoint, batch):
    return run(checkpoint, batch)[0]


def test_moe_bf16_parity_in_graphs(graph_tokens, reference, hf_model, batch):
    check_parity(graph_tokens, reference, hf_model, batch)


def test_moe_graphs_equal_eager(checkpoint, batch, graph_tokens):
    eager, _ = run(checkpoint, batch, enforce_eager=True)
    assert torch.equal(eager, graph_tokens)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=128, block_size=32),  # chunked prefill in mixed steps
    dict(num_kv_blocks=64),  # the four prompts' 48 new tokens do not fit: preemption
])
def test_moe_scheduling_modes(checkpoint, batch, reference, hf_model, options):
    tokens, stats = run(checkpoint, batch, **options)
    check_parity(tokens, reference, hf_model, batch)
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0
