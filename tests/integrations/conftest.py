"""A tiny random Qwen3 checkpoint with its tokenizer (as ``hf-paged make-checkpoint`` writes
it), and its stock transformers twin."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_paged.random_checkpoint import make_checkpoint

# Small enough for a fast CPU cache; every test model loads with these.
SMALL = dict(max_model_len=128, num_kv_blocks=64, block_size=8)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny_tok")), dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="session")
def stock_model(tiny_checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).eval()
