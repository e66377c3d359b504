"""Qwen3-Next (model_type ``qwen3_next``): transformers' ``Qwen3NextForCausalLM`` with paged
modules. The family interface is described in ``families/qwen3.py``; a hybrid family also
declares ``linear_layer_ids(config)`` and ``state_shapes(config, tp_size)``, what the worker
needs to give each linear-attention layer its state pools.

Layers interleave, as ``config.layer_types`` says, Gated DeltaNet linear attention
(``layer.linear_attn``: ``modeling.gated_deltanet``, Qwen3-Next's interleaved ``in_proj_qkvz``
/ ``in_proj_ba`` merged into ``in_proj_qkvzba``) and gated full attention
(``layer.self_attn``: Qwen3's attention with an output gate, zero-centred q/k norms and
partial RoPE). Every norm is zero-centred. A layer
transformers built sparse gets the routed experts plus the gated shared expert
(``modeling.moe_shared``), the others Qwen3's dense MLP. Experts load from either of
Qwen3-MoE's layouts (``families/qwen3_moe.py``). Qwen3.5 (``families/qwen3_5.py``) reuses
this module with its own projections.

FP8 checkpoints of these families are not served yet.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_paged.families import qwen3, qwen3_moe
from hf_paged.families.qwen3 import Qwen3PagedAttention, Qwen3PagedMLP
from hf_paged.modeling.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetShape,
    projection_groups,
)
from hf_paged.modeling.linear import divide
from hf_paged.modeling.loader import PackedModules
from hf_paged.modeling.moe_shared import SharedExpertMoEBlock
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout
from hf_paged.quantization.fp8 import Fp8Scheme

NAME = "Qwen3-Next"
MODEL_TYPES = ("qwen3_next",)
ARCHITECTURE = "Qwen3NextForCausalLM"
INNER_MODEL = "Qwen3NextModel"
OUTPUT = "MoeCausalLMOutputWithPast"  # its aux_loss and router_logits stay None
# attention, dense MLPs and shared experts as Qwen3's; the linear layers' input projections
PACKED_MODULES = {**qwen3.PACKED_MODULES, "in_proj_qkvz": ("in_proj_qkvzba", 0),
                  "in_proj_ba": ("in_proj_qkvzba", 1)}
LAYER_TYPES = ("linear_attention", "full_attention")
checkpoint_keys = qwen3_moe.checkpoint_keys  # experts in either layout


def weight_target(name: str, packed_modules: PackedModules = PACKED_MODULES
                  ) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills and its shard id: experts as Qwen3-MoE's, a
    projection of ``packed_modules`` to its merged one."""
    return qwen3_moe.weight_target(name, packed_modules)


def packed_sizes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Rows of each checkpoint tensor in a merged projection, in ``PACKED_MODULES`` order."""
    return hybrid_packed_sizes(config, split_projections=False)


def hybrid_packed_sizes(config: PretrainedConfig, split_projections: bool
                        ) -> dict[str, tuple[int, ...]]:
    """``packed_sizes`` of a Qwen3-Next-style model (``split_projections``: Qwen3.5's); a key
    naming a module's parent too (``shared_expert.gate_up_proj``) overrides the plain one for
    those modules. ``q_proj`` holds each head's query and gate."""
    head_dim = config.head_dim
    kv = config.num_key_value_heads * head_dim
    sizes = {"qkv_proj": (2 * config.num_attention_heads * head_dim, kv, kv),
             "in_proj_qkvzba": tuple(sum(group) for group in
                                     projection_groups(config, split_projections))}
    if getattr(config, "intermediate_size", None):  # dense layers (Qwen3.5-MoE has none)
        sizes["gate_up_proj"] = (config.intermediate_size,) * 2
    if getattr(config, "num_experts", 0):
        sizes["shared_expert.gate_up_proj"] = (config.shared_expert_intermediate_size,) * 2
    return sizes


def saved_layout(state: dict[str, torch.Tensor], scheme: Fp8Scheme | None
                 ) -> dict[str, torch.Tensor]:
    """These families save transformers' own keys (experts fused, as transformers 5)."""
    return state


def linear_layer_ids(config: PretrainedConfig) -> tuple[int, ...]:
    """The indices of the Gated DeltaNet layers."""
    return tuple(i for i, kind in enumerate(config.layer_types) if kind == "linear_attention")


def state_shapes(config: PretrainedConfig, tp_size: int
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """One state slot of one linear-attention layer on one of ``tp_size`` ranks: each pool's
    attribute name -> (shape, dtype; None: the model dtype)."""
    return GatedDeltaNetShape(config, tp_size).state_shapes()


def check_config(config: PretrainedConfig) -> None:
    """Raise ValueError for a Qwen3-Next (or Qwen3.5) config these modules cannot run."""
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    other = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if other:
        raise ValueError(f"layer_types {other} are not supported by hf_paged (only "
                         f"{', '.join(LAYER_TYPES)})")
    if "full_attention" not in config.layer_types:  # the paged KV cache sizes by them
        raise ValueError("layer_types has no 'full_attention' layer; hf_paged serves hybrid "
                         "models with at least one")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types names {len(config.layer_types)} layers, "
                         f"num_hidden_layers is {config.num_hidden_layers}")
    rotary = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    if rotary % 2 or not 0 < rotary <= config.head_dim:
        raise ValueError(f"partial_rotary_factor gives {rotary} rotary dimensions of head_dim "
                         f"{config.head_dim}: not an even number between 2 and head_dim")
    if config.linear_conv_kernel_dim < 2:
        raise ValueError(f"linear_conv_kernel_dim ({config.linear_conv_kernel_dim}) must be at "
                         "least 2")
    experts, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts "
                         f"({experts})")


def check_shardable(config: PretrainedConfig, tp_size: int,
                    block: tuple[int, int] | None = None, expert_parallel: bool = False
                    ) -> None:
    """Raise ValueError, naming both numbers, when ``tp_size`` ranks cannot split the model:
    attention's heads, the linear layers' key and value heads, the dense and the experts'
    intermediate sizes (with ``expert_parallel``, the routed experts themselves:
    ``num_experts``). FP8 weights (``block``) are served on one rank: a rank's share of
    ``in_proj_qkvz`` (every key head's query, key, value and z rows together) would cut the
    checkpoint's blocks."""
    if block is not None and tp_size > 1:
        raise ValueError(f"FP8 checkpoints of {config.model_type} are not supported by hf_paged "
                         f"with tensor_parallel_size > 1 (got {tp_size})")
    kv_head_layout(config.num_attention_heads, config.num_key_value_heads, tp_size)
    GatedDeltaNetShape(config, tp_size)
    sparse = _sparse_layers(config)
    if not all(sparse):
        divide(config.intermediate_size, tp_size, "intermediate_size")
    if any(sparse):
        if expert_parallel:
            divide(config.num_experts, tp_size, "num_experts")
        else:
            divide(config.moe_intermediate_size, tp_size, "moe_intermediate_size")
        divide(config.shared_expert_intermediate_size, tp_size,
               "shared_expert_intermediate_size")


def _sparse_layers(config: PretrainedConfig) -> list[bool]:
    """Which layers transformers builds sparse (Qwen3-Next's rule; Qwen3.5's configs lack
    experts, or the step and the dense list, and are all dense or all sparse)."""
    experts = getattr(config, "num_experts", 0)
    step, dense = (getattr(config, "decoder_sparse_step", 1),
                   getattr(config, "mlp_only_layers", None) or ())
    return [bool(experts) and i not in dense and (i + 1) % step == 0
            for i in range(config.num_hidden_layers)]


def swap_modules(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
    """transformers' ``Qwen3NextForCausalLM`` (on meta) -> this rank's paged modules, in
    place."""
    swap_hybrid(model, attention_backend, max_positions, tp, split_projections=False)


def swap_hybrid(model: nn.Module, attention_backend: str, max_positions: int,
                tp: TensorParallel, split_projections: bool) -> None:
    """Swap a Qwen3-Next-style hybrid decoder (on meta) in place; ``split_projections``:
    Qwen3.5's Gated DeltaNet input projections."""
    config = model.config

    def token_mixer(layer: nn.Module) -> None:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn = GatedDeltaNet(config, split_projections, tp)
        else:
            layer.self_attn = Qwen3PagedAttention(config, attention_backend, tp, gated=True)

    def feed_forward(layer: nn.Module) -> nn.Module:
        if not hasattr(layer.mlp, "experts"):
            return Qwen3PagedMLP(config, tp)
        shared = Qwen3PagedMLP(config, tp, config.shared_expert_intermediate_size)
        return SharedExpertMoEBlock(
            config.num_experts, config.num_experts_per_tok,
            getattr(config, "norm_topk_prob", True),  # Qwen3.5-MoE always renormalises
            config.hidden_size, config.moe_intermediate_size, shared, tp)

    qwen3.swap_decoder(model, attention_backend, max_positions, tp, feed_forward, token_mixer,
                       zero_centred=True)
