"""The engine's parameters in transformers' checkpoint layout."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from hf_paged.modeling.loader import PACKED_MODULES


def transformers_state_dict(state: dict[str, torch.Tensor],
                            config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """``state`` with each fused projection (``qkv_proj``, ``gate_up_proj``) split back into
    the checkpoint tensors it was loaded from. The parts are copies: safetensors refuses to
    save tensors that share memory."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    sizes = {"qkv_proj": (q, kv, kv), "gate_up_proj": (config.intermediate_size,) * 2}
    parts: dict[str, list[str]] = {}
    for name, (merged, _) in PACKED_MODULES.items():  # checkpoint names in shard order
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
