"""PEFT LoRA adapters of the tiny checkpoint, made and run by PEFT itself: the adapters a test
serves, and stock transformers + PEFT's greedy tokens with them, the oracle."""

from __future__ import annotations

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

# name -> (seed, target modules): one adapter on attention, one on the rest of each layer.
ADAPTERS = {"a": (1, ["q_proj", "v_proj"]),
            "b": (2, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
# lora_B scaled up from PEFT's random initialisation, so that each adapter's greedy tokens
# differ from the base model's and from the other's.
B_SCALE = 20.0


def stock_model(checkpoint: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32).eval()


def save_adapter(checkpoint: str, out: str, seed: int, targets: list[str],
                 **config) -> str:
    """A random LoRA adapter of ``checkpoint`` saved by PEFT's ``save_pretrained`` in
    ``out``."""
    torch.manual_seed(seed)
    model = get_peft_model(stock_model(checkpoint), LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(B_SCALE)
    model.save_pretrained(out)
    return out


def save_adapters(checkpoint: str, root) -> dict[str, str]:
    """``ADAPTERS`` saved in folders under ``root``: name -> folder."""
    return {name: save_adapter(checkpoint, str(root / name), seed, targets)
            for name, (seed, targets) in ADAPTERS.items()}


def peft_greedy(checkpoint: str, adapter: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy new tokens under stock transformers with ``adapter`` (a folder;
    None: the base model), one prompt a call (no padding), stopping at the checkpoint's EOS."""
    model = stock_model(checkpoint)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
    return outs
