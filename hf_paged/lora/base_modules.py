"""A Qwen3 / Qwen3-MoE base model's modules by name, as LoRA targets see them.

Names are the checkpoints' layout, which adapters name their keys by: every MoE expert one
linear per projection (``mlp.experts.3.gate_proj``), as transformers 4 built them. Each module
says whether it is linear (what PEFT's ``"all-linear"`` reaches) and either which served
projection it is or why LoRA on it is not served.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PretrainedConfig

from hf_paged.lora.adapter import PROJECTIONS

SERVED_MODEL_TYPES = ("qwen3", "qwen3_moe")
SERVED = ("served: LoRA on " + ", ".join(PROJECTIONS)
          + " of the decoder layers (on Qwen3-MoE the attention and the dense MLP layers)")
EXPERTS = "LoRA on MoE experts is not supported"
ROUTER = "LoRA on the MoE router (mlp.gate) is not supported"
_ATTENTION = PROJECTIONS[:4]
_MLP = PROJECTIONS[4:]


@dataclass(frozen=True)
class BaseModule:
    name: str  # as named_modules() of the transformers model names it
    linear: bool
    projection: tuple[int, str] | None  # (layer, projection) where LoRA on it is served
    refusal: str | None  # why LoRA on it is not served; None for a served projection


def check_model_type(config: PretrainedConfig) -> None:
    if config.model_type not in SERVED_MODEL_TYPES:
        raise ValueError(f"LoRA on a base model of model_type {config.model_type!r} is not "
                         f"supported; served: {', '.join(SERVED_MODEL_TYPES)}")


def is_sparse(config: PretrainedConfig, layer: int) -> bool:
    """Whether a decoder layer's MLP is a sparse MoE block (transformers' Qwen3-MoE rule)."""
    if config.model_type != "qwen3_moe":
        return False
    return (layer not in config.mlp_only_layers and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


def base_modules(config: PretrainedConfig) -> list[BaseModule]:
    """Every module of the base model below its root, in named_modules() order."""
    check_model_type(config)

    def other(name: str, linear: bool = False, refusal: str | None = None) -> BaseModule:
        leaf = name.rpartition(".")[2]
        return BaseModule(name, linear, None, refusal or f"LoRA on {leaf} is not supported")

    modules = [other("model"), other("model.embed_tokens"), other("model.layers")]
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        modules += [other(layer), other(f"{layer}.self_attn")]
        modules += [BaseModule(f"{layer}.self_attn.{p}", True, (i, p), None) for p in _ATTENTION]
        modules += [other(f"{layer}.self_attn.q_norm"), other(f"{layer}.self_attn.k_norm"),
                    other(f"{layer}.mlp")]
        if is_sparse(config, i):
            modules.append(other(f"{layer}.mlp.gate", True, ROUTER))
            modules.append(other(f"{layer}.mlp.experts", refusal=EXPERTS))
            for e in range(config.num_experts):
                modules.append(other(f"{layer}.mlp.experts.{e}", refusal=EXPERTS))
                modules += [other(f"{layer}.mlp.experts.{e}.{p}", True, EXPERTS) for p in _MLP]
                modules.append(other(f"{layer}.mlp.experts.{e}.act_fn", refusal=EXPERTS))
        else:
            modules += [BaseModule(f"{layer}.mlp.{p}", True, (i, p), None) for p in _MLP]
            modules.append(other(f"{layer}.mlp.act_fn"))
        modules += [other(f"{layer}.input_layernorm"), other(f"{layer}.post_attention_layernorm")]
    modules += [other("model.norm"), other("model.rotary_emb"), other("lm_head", True)]
    return modules


def explain(config: PretrainedConfig, name: str) -> str:
    """Why an adapter tensor on module ``name`` cannot be served."""
    for module in base_modules(config):
        if module.name == name:
            return module.refusal or f"{name} is not a module the adapter's config targets"
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer and int(layer[1]) >= config.num_hidden_layers:
        return (f"layer {layer[1]} is beyond the base model's "
                f"num_hidden_layers={config.num_hidden_layers}")
    if ".mlp.experts" in name:
        return EXPERTS
    if layer and re.search(r"\.mlp\.(gate|up|down)_proj$", name):
        return f"layer {layer[1]} is a sparse MoE layer: it has no dense {name.rpartition('.')[2]}"
    return f"{name} is not a module of the {config.model_type} base model"


def projection_shape(config: PretrainedConfig, projection: str) -> tuple[int, int]:
    """A served projection's (in_features, out_features)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[projection]
