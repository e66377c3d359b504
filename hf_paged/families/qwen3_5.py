"""Qwen3.5's text model (model_type ``qwen3_5_text``): transformers' ``Qwen3_5ForCausalLM``
with paged modules. The family interface is described in ``families/qwen3.py``; the modules
are Qwen3-Next's (``families/qwen3_next.py``) with Qwen3.5's Gated DeltaNet input projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and dense MLPs. Its RoPE is
transformers' multimodal one, which on text positions (the same on every axis) is plain
partial RoPE.

Checkpoints hold ``Qwen3_5ForCausalLM``'s keys (as its ``save_pretrained`` writes them); the
vision-language releases' ``model.language_model.*`` layout is not read.
"""

from __future__ import annotations

from torch import nn

from hf_paged.families import qwen3_next
from hf_paged.modeling.tp import SINGLE, TensorParallel

NAME = "Qwen3.5"
MODEL_TYPES = ("qwen3_5_text",)
ARCHITECTURE = "Qwen3_5ForCausalLM"
INNER_MODEL = "Qwen3_5TextModel"
OUTPUT = "CausalLMOutputWithPast"
PACKED_MODULES = qwen3_next.PACKED_MODULES
packed_sizes = qwen3_next.packed_sizes
checkpoint_keys = qwen3_next.checkpoint_keys
weight_target = qwen3_next.weight_target
saved_layout = qwen3_next.saved_layout
check_config = qwen3_next.check_config
check_shardable = qwen3_next.check_shardable
linear_layer_ids = qwen3_next.linear_layer_ids
state_shapes = qwen3_next.state_shapes


def swap_modules(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
    """transformers' ``Qwen3_5ForCausalLM`` (on meta) -> this rank's paged modules, in
    place."""
    qwen3_next.swap_hybrid(model, attention_backend, max_positions, tp, split_projections=True)
