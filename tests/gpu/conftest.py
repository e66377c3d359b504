"""The GPU tests' shared fixtures, built once for every file: a random bf16 checkpoint of the
Qwen3-0.6B shape, a padded batch of four prompts, stock transformers on it and transformers'
greedy tokens and logits."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_paged.random_checkpoint import make_checkpoint
from tests.gpu.test_gpu_parity import (
    LENGTHS,
    left_padded,
    load_transformers,
    transformers_generate,
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return make_checkpoint("0.6b", str(tmp_path_factory.mktemp("qwen3-0.6b")), dtype="bfloat16",
                           device="cuda")


@pytest.fixture(scope="session")
def batch():
    gen = torch.Generator().manual_seed(0)
    return left_padded([torch.randint(0, 10000, (n,), generator=gen) for n in LENGTHS])


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    model = load_transformers(checkpoint)
    yield model
    del model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def reference(hf_model, batch):
    return transformers_generate(hf_model, batch)
