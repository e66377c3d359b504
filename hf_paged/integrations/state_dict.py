"""The engine's parameters in transformers' checkpoint layout."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from hf_paged import families, quantization


def transformers_state_dict(state: dict[str, torch.Tensor],
                            config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """``state`` with each fused projection of the family (Qwen3's ``qkv_proj``,
    ``gate_up_proj``) split back into the checkpoint tensors it was loaded from; an FP8
    projection's ``weight_scale_inv`` grid into each part's grid. The parts are copies:
    safetensors refuses to save tensors that share memory."""
    family = families.family_for(config)
    sizes = family.packed_sizes(config)
    scheme = quantization.resolve(config)
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
        # the most specific entry: "shared_expert.gate_up_proj" before "gate_up_proj"
        split = next(sizes[name] for name in sorted(sizes, key=len, reverse=True)
                     if module == name or module.endswith(f".{name}"))
        if leaf == "weight_scale_inv":  # each part's grid rows
            split = [-(-rows // scheme.block[0]) for rows in split]
        for name, piece in zip(parts[merged], tensor.split(split, dim=0)):
            out[f"{prefix}.{name}.{leaf}"] = piece.clone()
    return family.saved_layout(out, scheme)
