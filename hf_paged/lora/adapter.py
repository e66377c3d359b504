"""One LoRA adapter's weights as the engine consumes them: plain tensors per decoder-layer
projection, with the scaling PEFT multiplies the low-rank product by."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The projections LoRA is served on: Qwen3's attention and dense-MLP linears.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraWeight:
    """One projection's update: ``scaling * (x @ a.T) @ b.T`` added to ``x @ W.T``."""

    a: torch.Tensor  # [r, in_features]: PEFT's lora_A.weight
    b: torch.Tensor  # [out_features, r]: PEFT's lora_B.weight
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (per module)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    weights: dict[tuple[int, str], LoraWeight]  # (layer index, projection in PROJECTIONS)

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.weights.values()), default=0)

    def nbytes(self) -> int:
        """The memory its tensors take."""
        return sum(t.numel() * t.element_size()
                   for w in self.weights.values() for t in (w.a, w.b))
