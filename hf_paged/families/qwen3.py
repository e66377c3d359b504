"""Qwen3 (model_type ``qwen3``): transformers' ``Qwen3ForCausalLM`` with paged modules.

A family module is everything hf_paged knows of one architecture; ``hf_paged.families`` maps
model_types to it and imports it on first use. The next family copies this shape:

- ``NAME``, ``MODEL_TYPES``: how messages name the family, and the ``config.model_type``
  values it claims (``families.REGISTRY`` points each of them here).
- ``ARCHITECTURE``, ``INNER_MODEL``: the names, in ``transformers``, of its causal-LM class
  (the skeleton the weights load into, and the base of the drop-in class, which keeps its
  name: pipelines check models by it) and of the inner model class (``model.model``).
- ``OUTPUT``: the name, in ``transformers.modeling_outputs``, of the class the causal LM's
  forward returns.
- ``PACKED_MODULES``: its fused weight groups, checkpoint projection -> (merged module, shard
  id), which the loader fills and ``state_dict()`` splits back; ``packed_sizes(config)``: each
  merged module's part sizes, in checkpoint order.
- ``check_config(config)`` and ``check_shardable(config, tp_size, block, expert_parallel)``:
  a ValueError naming what the modules cannot run, or what ``tp_size`` ranks cannot split
  (both numbers named; ``block``: FP8 weights' block size, whose blocks a rank's slice must
  not cut; ``expert_parallel``: routed experts split whole, not by their intermediate size).
- ``checkpoint_keys(expected, found)``: transformers' keys and full shapes (``expected``)
  restated in the layout of a checkpoint holding the keys ``found``, where a family's
  checkpoints name tensors otherwise; ``weight_target(name)``: the parameter a checkpoint
  tensor fills and its shard id (a merged module's part), for the modules' ``weight_loader``.
- ``saved_layout(state, scheme)``: transformers' state dict (merged modules split back) in the
  layout ``save_pretrained`` writes, where a quantized model's differs (``scheme``: its
  quantization, or None).
- ``swap_modules(model, attention_backend, max_positions, tp)``: on the meta device, replace
  every module of transformers' model that ``PagedModel.forward`` runs by this rank's paged
  one, as ``hf_paged.modeling.paged_model`` describes them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_paged import kernels
from hf_paged.modeling.attention import AttentionMetadata, attention_function
from hf_paged.modeling.embedding import ParallelLMHead, VocabParallelEmbedding
from hf_paged.modeling.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
    keep_computing,
)
from hf_paged.modeling.loader import target_of
from hf_paged.modeling.norm import RMSNorm
from hf_paged.modeling.rotary import RotaryEmbedding
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout
from hf_paged.quantization.fp8 import Fp8Scheme, check_split

NAME = "Qwen3"
MODEL_TYPES = ("qwen3",)
ARCHITECTURE = "Qwen3ForCausalLM"
INNER_MODEL = "Qwen3Model"
OUTPUT = "CausalLMOutputWithPast"
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def packed_sizes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Rows of each checkpoint tensor in a merged projection, in ``PACKED_MODULES`` order."""
    q = config.num_attention_heads * _head_dim(config)
    kv = config.num_key_value_heads * _head_dim(config)
    return {"qkv_proj": (q, kv, kv), "gate_up_proj": (config.intermediate_size,) * 2}


def checkpoint_keys(expected: dict[str, tuple[int, ...]],
                    found: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Qwen3 checkpoints name transformers' own keys."""
    return expected


def weight_target(name: str) -> tuple[str, object]:
    """A checkpoint tensor's parameter and shard id: q/k/v and gate/up go to their merged
    projection."""
    return target_of(name, PACKED_MODULES)


def saved_layout(state: dict[str, torch.Tensor], scheme: Fp8Scheme | None
                 ) -> dict[str, torch.Tensor]:
    """Qwen3 saves transformers' own keys."""
    return state


def check_config(config: PretrainedConfig) -> None:
    """Raise ValueError for a Qwen3 config these modules cannot run."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("sliding-window attention layers are not supported by hf_paged")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")


def check_shardable(config: PretrainedConfig, tp_size: int,
                    block: tuple[int, int] | None = None, expert_parallel: bool = False
                    ) -> None:
    """Raise ValueError, naming both numbers, when ``tp_size`` ranks cannot split the model
    (with FP8 weights of ``block``: without cutting a block)."""
    kv_head_layout(config.num_attention_heads, config.num_key_value_heads, tp_size)
    divide(config.intermediate_size, tp_size, "intermediate_size")
    check_attention_blocks(config, tp_size, block)
    check_mlp_blocks("intermediate_size", config.intermediate_size, tp_size, block,
                     "gate_up_proj", "down_proj")


def check_attention_blocks(config: PretrainedConfig, tp_size: int,
                           block: tuple[int, int] | None) -> None:
    """FP8 attention projections under ``tp_size`` ranks: each rank's q/k/v rows and o_proj
    columns whole blocks (a replicated KV head may be all there is)."""
    if block is None:
        return
    heads, kv_heads = kv_head_layout(config.num_attention_heads, config.num_key_value_heads,
                                     tp_size)
    head_dim, (bn, bk) = _head_dim(config), block
    q = config.num_attention_heads * head_dim
    check_split("num_attention_heads * head_dim", q, heads * head_dim, tp_size, bn, "row",
                "q_proj")
    check_split("num_key_value_heads * head_dim", config.num_key_value_heads * head_dim,
                kv_heads * head_dim, tp_size, bn, "row", "k_proj and v_proj")
    check_split("num_attention_heads * head_dim", q, heads * head_dim, tp_size, bk, "column",
                "o_proj")


def check_mlp_blocks(what: str, size: int, tp_size: int, block: tuple[int, int] | None,
                     gate_up: str, down: str) -> None:
    """FP8 feed-forward weights of ``size`` intermediate features under ``tp_size`` ranks:
    each rank's gate/up rows and down columns whole blocks."""
    if block is not None:
        check_split(what, size, size // tp_size, tp_size, block[0], "row", gate_up)
        check_split(what, size, size // tp_size, tp_size, block[1], "column", down)


def swap_modules(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
    """transformers' ``Qwen3ForCausalLM`` (on meta) -> this rank's paged modules, in place."""
    swap_decoder(model, attention_backend, max_positions, tp,
                 lambda layer: Qwen3PagedMLP(model.config, tp))


def swap_decoder(model: nn.Module, attention_backend: str, max_positions: int,
                 tp: TensorParallel, feed_forward: Callable[[nn.Module], nn.Module],
                 token_mixer: Callable[[nn.Module], None] | None = None,
                 zero_centred: bool = False) -> None:
    """Swap a Qwen3-style decoder (on meta) in place: Qwen3's attention (or what
    ``token_mixer(layer)`` swaps in, a hybrid model's) and norms (``zero_centred``: the
    offset norms of Qwen3-Next and Qwen3.5), the embedding, RoPE and LM head, and each layer's
    feed-forward block for what ``feed_forward(layer)`` builds from transformers' layer."""
    config, inner = model.config, model.model
    eps = config.rms_norm_eps
    for layer in inner.layers:
        if token_mixer is None:
            layer.self_attn = Qwen3PagedAttention(config, attention_backend, tp)
        else:
            token_mixer(layer)
        layer.mlp = feed_forward(layer)
        layer.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centred)
        layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centred)
        if not zero_centred:  # the small-M kernel fuses these norms into the projections after
            for block, proj in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
                if isinstance(block, (Qwen3PagedAttention, Qwen3PagedMLP)):
                    getattr(block, proj).fuses_norm = True
    inner.norm = RMSNorm(config.hidden_size, eps, zero_centred)
    inner.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
    inner.rotary_emb = RotaryEmbedding(inner.rotary_emb, max_positions)
    model.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)


class Qwen3PagedAttention(nn.Module):
    """Merged QKV projection, per-head q/k RMSNorm, RoPE, paged attention, output projection.

    The caches ``k_cache``/``v_cache`` (``[num_blocks, block_size, kv_heads, head_dim]``) are
    attached by the model runner once it has sized them; an FP8 cache's float32 scales per KV
    head, ``k_scale``/``v_scale``, beside them (``worker.kv_cache``).

    ``gated``: the gated attention of Qwen3-Next and Qwen3.5, whose ``q_proj`` gives each head
    its query and an output gate: the attention output times ``sigmoid(gate)`` goes into
    ``o_proj``. Their q/k norms are zero-centred (``RMSNorm(offset=True)``) and their RoPE
    partial (the rotary table narrower than a head).
    """

    def __init__(self, config: PretrainedConfig, backend: str, tp: TensorParallel = SINGLE,
                 gated: bool = False):
        super().__init__()
        head_dim = _head_dim(config)
        self.gated = gated
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias, tp=tp, gated_query=gated,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=config.attention_bias,
            tp=tp,
        )
        keep_computing(self, "o_proj")
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, offset=gated)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, offset=gated)
        self.attend = attention_function(backend)
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """A checkpoint's KV-cache scales, one number or one per KV head of the whole model:
        this rank's heads' (``QKVParallelLinear.kv_shard``)."""
        first = self.qkv_proj.kv_shard * self.num_kv_heads
        self.k_scale, self.v_scale = (
            s.expand(self.num_kv_heads).clone() if s.numel() == 1
            else s[first:first + self.num_kv_heads].clone() for s in (k_scale, v_scale))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        norm: nn.Module, meta: AttentionMetadata, rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(hidden, residual)``, and the new residual stream."""
        qkv, residual = self.qkv_proj.normed(hidden, residual, norm)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_rows = self.num_heads * self.qkv_proj.q_head_rows
        q, k, v = qkv.split([q_rows, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.qkv_proj.q_head_rows)
        if self.gated:  # each head's query, then its gate
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        q, _ = kernels.norm_rope_store(
            q, k.reshape(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim),
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            positions, rotary.cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping,
            self.k_scale, self.v_scale, offset=self.q_norm.offset,
        )
        out = self.attend(
            q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            self.scale, max_query_len=meta.max_query_len, shared_prefix=meta.shared_prefix,
            order=meta.decode_order, k_scale=self.k_scale, v_scale=self.v_scale,
        ).reshape(-1, q_size)
        if self.gated:  # in the model dtype, as transformers' attn_output * sigmoid(gate)
            out = out * torch.sigmoid(gate.reshape(-1, q_size))
        return self.compute["o_proj"](out), residual


class Qwen3PagedMLP(nn.Module):
    """The SwiGLU feed-forward block with the gate and up projections merged, of
    ``intermediate`` features (None: ``config.intermediate_size``)."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE,
                 intermediate: int | None = None):
        super().__init__()
        inter = intermediate or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp=tp)
        keep_computing(self, "down_proj")

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(x, residual)``, and the new residual stream."""
        # gate_up's small_m_rows were measured for the gated kernel
        act, residual = self.gate_up_proj.normed(x, residual, norm, gated=True)
        return self.compute["down_proj"](act), residual
