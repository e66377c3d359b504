"""An FP8 KV cache's scales as checkpoints ship them, under the names vLLM reads (per layer
``i``, under ``model.layers.{i}.self_attn.``):

- ``k_scale`` / ``v_scale`` (ModelOpt, Quark and transformers' own FP8 KV checkpoints);
- ``k_proj.k_scale`` / ``v_proj.v_scale`` (older ModelOpt exports);
- ``k_proj.output_scale`` / ``v_proj.output_scale`` (compressed-tensors);
- ``kv_scale``: one scale for both (the oldest exports).

Each is one float32 number (per tensor) or one per KV head; the cache stores ``x / scale``.
The keys are optional: the loader consumes them (``PATTERN``) and the attention modules keep
them, used only when the cache is FP8 (``worker.kv_cache``).
"""

from __future__ import annotations

import re

import torch

from hf_paged.modeling.loader import Checkpoint

PATTERN = re.compile(r"^(model\.)?layers\.(\d+)\.self_attn\."
                     r"(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale"
                     r"|k_proj\.output_scale|v_proj\.output_scale)$")


def read_kv_scales(checkpoint: Checkpoint, num_layers: int, num_kv_heads: int
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer -> (k_scale, v_scale), float32 ``[1]`` or ``[num_kv_heads]`` on the CPU; empty
    when the checkpoint ships none. A checkpoint shipping them for some layers or tensors
    only, or of another size, is refused naming the key."""
    found: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    for name in sorted(checkpoint.shapes):
        match = PATTERN.match(name)
        if match is None:
            continue
        layer, kind = int(match.group(2)), match.group(3)
        scale = checkpoint.tensor(name).float().reshape(-1)
        if scale.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name}: a KV-cache scale holds 1 or num_key_value_heads "
                             f"({num_kv_heads}) numbers, got shape {list(scale.shape)}")
        for part in ("k", "v") if kind == "kv_scale" else (kind[0],):
            found.setdefault(layer, {})[part] = (name, scale)
    if not found:
        return {}
    scales = {}
    for layer in range(num_layers):
        parts = found.get(layer, {})
        for part in "kv":
            if part not in parts:
                raise ValueError(f"checkpoint {checkpoint.path} ships KV-cache scales, but not "
                                 f"model.layers.{layer}.self_attn.{part}_scale")
        scales[layer] = (parts["k"][1], parts["v"][1])
    return scales
