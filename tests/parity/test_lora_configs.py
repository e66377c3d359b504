"""LoRA adapters of configurations drawn at random (targets, ranks not powers of two, alphas,
rsLoRA, rank and alpha patterns, tiny shapes tied and untied, GQA and MHA) in the engine,
against stock transformers + peft on the same base and adapter (float32): the general rule,
beyond the adapters the other tests name."""

from __future__ import annotations

import random

import pytest
import torch

import hf_paged
from hf_paged.lora.reading import read_adapter
from tests.conftest import TINY_CONFIGS, left_padded
from tests.lora_adapters import ALL, save_adapter, stock_peft


def random_lora(seed: int) -> dict:
    rng = random.Random(seed)
    targets = rng.sample(ALL, rng.randint(1, len(ALL)))
    lora = dict(r=rng.randint(1, 40), lora_alpha=rng.choice([1, 8, 16, 32, 64]),
                target_modules=targets, use_rslora=rng.random() < 0.5)
    if rng.random() < 0.5:
        lora["rank_pattern"] = {rng.choice(targets): rng.randint(1, 24)}
    if rng.random() < 0.5:
        lora["alpha_pattern"] = {rng.choice(targets): rng.choice([2, 12, 48])}
    return lora


@pytest.mark.parametrize("seed", range(6))
def test_random_adapter_as_peft(checkpoints, tmp_path, seed):
    name = sorted(TINY_CONFIGS)[seed % len(TINY_CONFIGS)]
    base, lora = checkpoints[name], random_lora(seed)
    folder = save_adapter(base, str(tmp_path / "adapter"), seed, **lora)
    stock = stock_peft(base, {"x": folder})
    ids, mask = left_padded([5, 12, 8], TINY_CONFIGS[name]["vocab_size"], seed=seed)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
                  adapter_names=["x", "__base__", "x"])
    expected = stock.generate(input_ids=ids, **kwargs)
    with hf_paged.from_pretrained(base, device="cpu", dtype=torch.float32,
                                  max_lora_rank=40) as engine:
        engine.add_lora("x", read_adapter(folder, "x", engine.hf_config, torch.float32))
        assert torch.equal(engine.generate(ids, **kwargs), expected), lora
