"""Qwen3 self-attention over the paged KV cache, and the metadata every layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.modeling.linear import QKVParallelLinear, RowParallelLinear
from hf_paged.modeling.norm import RMSNorm
from hf_paged.modeling.rotary import RotaryEmbedding
from hf_paged.modeling.tp import SINGLE, TensorParallel


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (see ``kernels.reference``).

    ``slot_mapping [T]``: cache slot of each new token (-1: padding, not stored).
    ``cu_seqlens_q [B+1]``: query rows of each sequence. ``seq_lens [B]``: context length of
    each sequence after this step. ``block_tables [B, max_blocks]``: cache blocks per sequence.
    ``max_query_len``: longest query run in the batch (1 when decoding).
    ``shared_prefix [1]``: a decode hint, set when every sequence's context starts with the
    same blocks: how many tokens they hold (cascade attention; see ``kernels.attention``).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    shared_prefix: torch.Tensor | None = None


def attention_function(backend: str):
    """The paged attention implementation of a backend, all with reference's signature plus
    the hints ``max_query_len`` and ``shared_prefix``."""
    if backend == "sdpa":
        return lambda *args, max_query_len, shared_prefix=None: reference.paged_attention(*args)
    if backend == "triton":
        from hf_paged.kernels.attention import paged_attention

        return paged_attention
    if backend == "flash_attn":
        from hf_paged.kernels.flash_attn import paged_attention

        return lambda *args, shared_prefix=None, **hints: paged_attention(*args, **hints)
    raise ValueError(f"attention_backend {backend!r} is not available")


class Qwen3PagedAttention(nn.Module):
    """Merged QKV projection, per-head q/k RMSNorm, RoPE, paged attention, output projection.

    The caches ``k_cache``/``v_cache`` (``[num_blocks, block_size, kv_heads, head_dim]``) are
    attached by the model runner once it has sized them.
    """

    def __init__(self, config, backend: str, tp: TensorParallel = SINGLE):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias, tp=tp,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=config.attention_bias,
            tp=tp,
        )
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.attend = attention_function(backend)
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        norm: nn.Module, meta: AttentionMetadata, rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(hidden, residual)``, and the new residual stream."""
        qkv, residual = self.qkv_proj.normed(hidden, residual, norm)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, _ = kernels.norm_rope_store(
            q.reshape(-1, self.num_heads, self.head_dim),
            k.reshape(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim),
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            positions, rotary.cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping,
        )
        out = self.attend(
            q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            self.scale, max_query_len=meta.max_query_len, shared_prefix=meta.shared_prefix,
        )
        return self.o_proj(out.reshape(-1, q_size)), residual
