"""Qwen3.5-MoE's text model (model_type ``qwen3_5_moe_text``): transformers'
``Qwen3_5MoeForCausalLM`` with paged modules. The family interface is described in
``families/qwen3.py``; the modules are Qwen3.5's (``families/qwen3_5.py``) with every layer's
MLP the routed experts plus the gated shared expert (top-k weights always renormalised), as
Qwen3-Next's sparse layers (``families/qwen3_next.py``).
"""

from __future__ import annotations

from hf_paged.families import qwen3_5

NAME = "Qwen3.5-MoE"
MODEL_TYPES = ("qwen3_5_moe_text",)
ARCHITECTURE = "Qwen3_5MoeForCausalLM"
INNER_MODEL = "Qwen3_5MoeTextModel"
OUTPUT = "MoeCausalLMOutputWithPast"  # its aux_loss and router_logits stay None
PACKED_MODULES = qwen3_5.PACKED_MODULES
packed_sizes = qwen3_5.packed_sizes
checkpoint_keys = qwen3_5.checkpoint_keys
weight_target = qwen3_5.weight_target
saved_layout = qwen3_5.saved_layout
check_config = qwen3_5.check_config
check_shardable = qwen3_5.check_shardable
linear_layer_ids = qwen3_5.linear_layer_ids
state_shapes = qwen3_5.state_shapes
swap_modules = qwen3_5.swap_modules
