"""Tiny stock transformers models under PEFT's own LoRA, for the tests of hf_paged.lora."""

from __future__ import annotations

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import transformers_weight_conversion
from transformers import PretrainedConfig

from tests.conftest import MOE_CONFIGS, TINY_CONFIGS

CONFIGS = {**TINY_CONFIGS, **{f"moe_{name}": shape for name, shape in MOE_CONFIGS.items()}}


def base_config(name: str) -> PretrainedConfig:
    """The float32 config of a tiny shape of tests/conftest.py (``moe_``: a Qwen3-MoE one)."""
    shape = CONFIGS[name]
    return transformers.AutoConfig.for_model(**{"model_type": "qwen3", **shape},
                                             dtype="float32")


def peft_model(config: PretrainedConfig, seed: int = 0, **lora) -> PeftModel:
    """A stock model of ``config`` under a LoRA adapter "default" whose lora_B is random too
    (PEFT's own initialisation leaves it zero)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return get_peft_model(model, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM",
                                            **lora))


def lora_layers(model: PeftModel) -> dict[tuple[int, str], LoraLayer]:
    """PEFT's injected layers: (layer index, projection) -> the layer."""
    layers = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            parts = name.split(".")  # model.layers.<i>.<self_attn|mlp>.<projection>
            layers[int(parts[2]), parts[-1]] = module
    return layers


def plain_moe_matching(monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's matching as transformers 4 models had it. Under transformers 5 PEFT turns the
    gate_proj / up_proj / down_proj targets of a Qwen3-MoE model into parameters of the fused
    experts, in every sparse layer, and drops them from the dense ones; adapters that reach
    the dense MLP layers are the ones trained on transformers 4's layout."""
    monkeypatch.setattr(transformers_weight_conversion, "convert_peft_config_for_transformers",
                        lambda *args, **kwargs: None)
