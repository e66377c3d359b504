"""Qwen3.5's text model (model_type ``qwen3_5_text``): transformers' ``Qwen3_5ForCausalLM``
with paged modules. The family interface is described in ``families/qwen3.py``; the modules
are Qwen3-Next's (``families/qwen3_next.py``) with Qwen3.5's Gated DeltaNet input projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, merged into ``in_proj_qkvzba``)
and dense MLPs. Its RoPE is
transformers' multimodal one, which on text positions (the same on every axis) is plain
partial RoPE.

Checkpoints hold ``Qwen3_5ForCausalLM``'s keys (as its ``save_pretrained`` writes them); the
vision-language releases' ``model.language_model.*`` layout is not read.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from hf_paged.families import qwen3, qwen3_next
from hf_paged.modeling.tp import SINGLE, TensorParallel

NAME = "Qwen3.5"
MODEL_TYPES = ("qwen3_5_text",)
ARCHITECTURE = "Qwen3_5ForCausalLM"
INNER_MODEL = "Qwen3_5TextModel"
OUTPUT = "CausalLMOutputWithPast"
# attention and MLPs as Qwen3's; the linear layers' four input projections merged
PACKED_MODULES = {**qwen3.PACKED_MODULES, "in_proj_qkv": ("in_proj_qkvzba", 0),
                  "in_proj_z": ("in_proj_qkvzba", 1), "in_proj_b": ("in_proj_qkvzba", 2),
                  "in_proj_a": ("in_proj_qkvzba", 3)}
checkpoint_keys = qwen3_next.checkpoint_keys
saved_layout = qwen3_next.saved_layout
check_config = qwen3_next.check_config
linear_layer_ids = qwen3_next.linear_layer_ids
state_shapes = qwen3_next.state_shapes


def check_shardable(config: PretrainedConfig, tp_size: int,
                    block: tuple[int, int] | None = None, expert_parallel: bool = False
                    ) -> None:
    """Qwen3-Next's checks, and with FP8 weights (``block``): ``in_proj_qkv`` holds the
    query, key and value rows as one checkpoint tensor under one scale grid, which the
    projection splits into its parts, so the query and key rows must be whole blocks."""
    if block is not None:
        keys = config.linear_num_key_heads * config.linear_key_head_dim
        if keys % block[0]:
            raise ValueError(
                f"FP8 checkpoints of {config.model_type}: in_proj_qkv's query and key rows "
                f"({keys} each, linear_num_key_heads x linear_key_head_dim) are not whole "
                f"{block[0]}-row blocks of weight_block_size, so its scale grid cannot be "
                "split between them")
    qwen3_next.check_shardable(config, tp_size, block, expert_parallel)


def packed_sizes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Rows of each checkpoint tensor in a merged projection, in ``PACKED_MODULES`` order."""
    return qwen3_next.hybrid_packed_sizes(config, split_projections=True)


def weight_target(name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills and its shard id (Qwen3-Next's rule over this
    family's ``PACKED_MODULES``)."""
    return qwen3_next.weight_target(name, PACKED_MODULES)


def swap_modules(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
    """transformers' ``Qwen3_5ForCausalLM`` (on meta) -> this rank's paged modules, in
    place."""
    qwen3_next.swap_hybrid(model, attention_backend, max_positions, tp, split_projections=True)
