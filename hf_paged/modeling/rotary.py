"""Rotary position embedding from a cos/sin table computed with transformers' own RoPE
initialisers, so every RoPE variant transformers computes statically (default, linear, yarn,
llama3) matches it bit for bit."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# These recompute frequencies from the running sequence length: no static table exists.
_DYNAMIC_ROPE = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_rotary: nn.Module, max_positions: int):
        super().__init__()
        self.rope_type = getattr(hf_rotary, "rope_type", "default")
        if self.rope_type in _DYNAMIC_ROPE:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported by hf_paged")
        self.config = hf_rotary.config
        self.default_init = hf_rotary.compute_default_rope_parameters
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    @torch.no_grad()
    def build_cache(self, device: torch.device) -> None:
        """Fill ``cos_sin_cache [max_positions, head_dim]`` in float32: cos half, sin half."""
        init = self.default_init if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[
            self.rope_type]
        inv_freq, scaling = init(self.config)  # on CPU, as transformers builds its buffer
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device, torch.float32)[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
