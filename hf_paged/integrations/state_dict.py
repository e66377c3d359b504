"""The engine's parameters in transformers' checkpoint layout."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from hf_paged import families


def transformers_state_dict(state: dict[str, torch.Tensor],
                            config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """``state`` with each fused projection of the family (Qwen3's ``qkv_proj``,
    ``gate_up_proj``) split back into the checkpoint tensors it was loaded from. The parts are
    copies: safetensors refuses to save tensors that share memory."""
    family = families.family_for(config)
    sizes = family.packed_sizes(config)
    parts: dict[str, list[str]] = {}
    for name, (merged, _) in family.PACKED_MODULES.items():  # checkpoint names in shard order
        parts.setdefault(merged, []).append(name)
    out = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        prefix, _, merged = module.rpartition(".")
        if merged not in parts:
            out[key] = tensor
            continue
        for name, piece in zip(parts[merged], tensor.split(sizes[merged], dim=0)):
            out[f"{prefix}.{name}.{leaf}"] = piece.clone()
    return out
