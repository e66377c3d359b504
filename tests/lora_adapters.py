"""PEFT LoRA adapters for the LoRA tests: saved by the real peft on a tiny checkpoint, their
lora_B drawn too (peft's own start is zero) and scaled so the adapters change greedy tokens;
and stock transformers + peft on them, the oracle."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Adapters of several forms: q/v only; all seven with rank and alpha per module and rsLoRA;
# attention only, another rank (also for Qwen3-MoE bases, whose MLPs peft puts on experts).
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1),
    "all": dict(r=8, lora_alpha=8, target_modules=ALL, rank_pattern={"v_proj": 4},
                alpha_pattern={r"layers\.1\..*": 24}, use_rslora=True),
    "attn": dict(r=16, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


def save_adapter(checkpoint: str, folder: str, seed: int, **lora) -> str:
    """A peft adapter on ``checkpoint`` saved to ``folder``."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4)
    model.save_pretrained(folder)
    return folder


def stock_peft(checkpoint: str, adapters: dict[str, str]) -> PeftModel:
    """Stock transformers on ``checkpoint`` with peft's adapters (name -> folder) loaded."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    (first, path), *rest = adapters.items()
    model = PeftModel.from_pretrained(model, path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model.eval()
