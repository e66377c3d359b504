"""Qwen3-MoE (model_type ``qwen3_moe``): transformers' ``Qwen3MoeForCausalLM`` with paged
modules. The family interface is described in ``families/qwen3.py``.

Attention is Qwen3's. Which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``,
``num_experts``) is transformers' own decision, read off its skeleton: a layer whose ``mlp``
transformers built as a sparse block gets a ``SparseMoEBlock``, the others Qwen3's dense MLP
of ``intermediate_size``.

Checkpoints hold the experts in either of two layouts, and each layer's may differ: the hub's
one matrix per expert and projection (``mlp.experts.{e}.gate_proj.weight``, ...) or
transformers 5's fused 3-D parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
``checkpoint_keys`` restates transformers' keys in the layout the checkpoint uses, so a
missing expert is reported by its own key. FP8 experts carry a ``weight_scale_inv`` grid per
matrix (``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` fused), read as their matrix is;
they save in the per-expert layout of Qwen's FP8 releases (``saved_layout``).
"""

from __future__ import annotations

import re
from collections.abc import Collection

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_paged.families import qwen3
from hf_paged.families.qwen3 import Qwen3PagedMLP
from hf_paged.modeling.linear import divide
from hf_paged.modeling.loader import PREFIX, PackedModules, target_of
from hf_paged.modeling.moe import SparseMoEBlock
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout
from hf_paged.quantization.fp8 import Fp8Scheme

NAME = "Qwen3-MoE"
MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURE = "Qwen3MoeForCausalLM"
INNER_MODEL = "Qwen3MoeModel"
OUTPUT = "MoeCausalLMOutputWithPast"  # its aux_loss and router_logits stay None
PACKED_MODULES = qwen3.PACKED_MODULES  # attention and the dense layers' MLP
packed_sizes = qwen3.packed_sizes

_FUSED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<name>gate_up_proj|down_proj)$")
_FUSED_STATE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<name>gate_up_proj|down_proj)"
                          r"(?P<scale>_scale_inv)?$")
_PER_EXPERT = re.compile(r"\.experts\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight"
                         r"(?P<scale>_scale_inv)?$")


def check_config(config: PretrainedConfig) -> None:
    """Raise ValueError for a Qwen3-MoE config these modules cannot run."""
    qwen3.check_config(config)
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported by "
                         "hf_paged")
    experts, top_k = config.num_experts, config.num_experts_per_tok
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts "
                         f"({experts})")


def _has_dense_layers(config: PretrainedConfig) -> bool:
    sparse_step = config.decoder_sparse_step
    return not config.num_experts or any(
        i in config.mlp_only_layers or (i + 1) % sparse_step
        for i in range(config.num_hidden_layers))


def check_shardable(config: PretrainedConfig, tp_size: int,
                    block: tuple[int, int] | None = None, expert_parallel: bool = False
                    ) -> None:
    """Raise ValueError, naming both numbers, when ``tp_size`` ranks cannot split the model:
    attention's heads, the dense layers' ``intermediate_size`` (when there are dense layers)
    and every expert's ``moe_intermediate_size`` (with FP8 weights of ``block``: without
    cutting a block), or with ``expert_parallel`` the experts themselves (``num_experts``)."""
    kv_head_layout(config.num_attention_heads, config.num_key_value_heads, tp_size)
    qwen3.check_attention_blocks(config, tp_size, block)
    if _has_dense_layers(config):
        divide(config.intermediate_size, tp_size, "intermediate_size")
        qwen3.check_mlp_blocks("intermediate_size", config.intermediate_size, tp_size, block,
                               "gate_up_proj", "down_proj")
    if config.num_experts and expert_parallel:
        divide(config.num_experts, tp_size, "num_experts")
    elif config.num_experts:
        divide(config.moe_intermediate_size, tp_size, "moe_intermediate_size")
        qwen3.check_mlp_blocks("moe_intermediate_size", config.moe_intermediate_size, tp_size,
                               block, "the experts' gate_up_proj", "the experts' down_proj")


def checkpoint_keys(expected: dict[str, tuple[int, ...]],
                    found: Collection[str]) -> dict[str, tuple[int, ...]]:
    """transformers' keys and full shapes, each layer's experts restated as one matrix per
    expert and projection unless the checkpoint holds either of that layer's fused tensors
    (then a missing one is named as the fused tensor)."""
    fused_layers = {m["experts"] for key in found
                    if (m := _FUSED.match(key if key.startswith(PREFIX) else PREFIX + key))}
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in expected.items():
        fused = _FUSED.match(key)
        if fused is None or fused["experts"] in fused_layers:
            out[key] = shape
            continue
        experts, hidden = fused["experts"], shape[1]
        for e in range(shape[0]):
            if fused["name"] == "down_proj":  # [E, H, I]
                out[f"{experts}.{e}.down_proj.weight"] = (hidden, shape[2])
            else:  # [E, 2 * I, H]: gate rows, then up rows
                for part in ("gate", "up"):
                    out[f"{experts}.{e}.{part}_proj.weight"] = (shape[1] // 2, shape[2])
    return out


def saved_layout(state: dict[str, torch.Tensor], scheme: Fp8Scheme | None
                 ) -> dict[str, torch.Tensor]:
    """FP8 experts in the hub's layout, one matrix and grid per expert and projection, as
    Qwen's FP8 releases hold them (stock transformers dequantizes that layout on a CPU, not
    the fused one); float experts as transformers 5 holds them."""
    if scheme is None:
        return state
    out = {}
    for key, tensor in state.items():
        fused = _FUSED_STATE.match(key)
        if fused is None:
            out[key] = tensor
            continue
        scale = fused["scale"] or ""
        names = ("down",) if fused["name"] == "down_proj" else ("gate", "up")
        for e, matrix in enumerate(tensor):
            for part, piece in zip(names, matrix.chunk(len(names))):
                out[f"{fused['experts']}.{e}.{part}_proj.weight{scale}"] = piece.clone()
    return out


def weight_target(name: str, packed_modules: PackedModules = PACKED_MODULES
                  ) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills and its shard id: one expert's matrix (or its
    FP8 scale grid) goes to its layer's fused experts parameter (or grid) as
    ``(expert, part)``, a projection of ``packed_modules`` to its merged one."""
    per_expert = _PER_EXPERT.search(name)
    if per_expert is None:
        return target_of(name, packed_modules)
    part = per_expert["part"]
    param = "down_proj" if part == "down" else "gate_up_proj"
    shard = (int(per_expert["expert"]), {"gate": 0, "up": 1, "down": None}[part])
    scale = "_scale_inv" if per_expert["scale"] else ""
    return f"{name[:per_expert.start()]}.experts.{param}{scale}", shard


def swap_modules(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
    """transformers' ``Qwen3MoeForCausalLM`` (on meta) -> this rank's paged modules, in
    place."""
    config = model.config

    def feed_forward(layer: nn.Module) -> nn.Module:
        if hasattr(layer.mlp, "experts"):  # transformers built a sparse block here
            return SparseMoEBlock(
                config.num_experts, config.num_experts_per_tok, config.norm_topk_prob,
                config.hidden_size, config.moe_intermediate_size, tp)
        return Qwen3PagedMLP(config, tp)

    qwen3.swap_decoder(model, attention_backend, max_positions, tp, feed_forward)
