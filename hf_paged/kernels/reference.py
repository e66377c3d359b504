"""Plain-torch versions of every kernel: the specification, the CPU path and the test oracle.

Numerics follow transformers' Qwen3 modules (cast points included) so that float32 runs on
CPU give the same tokens as stock ``generate``. Every Triton kernel in this package has a
twin here with the same signature and is tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels.block_scales import FP8
from hf_paged.kernels.lora_tiles import LoraTiles
from hf_paged.kernels.reference_conv import (  # noqa: F401  (twins of the convolution kernels)
    causal_conv_decode,
    causal_conv_prefill,
)
from hf_paged.kernels.reference_fp8 import (  # noqa: F401  (twins of the FP8 kernels)
    act_quant,
    dequant_linear,
    dequantize_kv,
    quantize_kv,
    w8a8_linear,
)
from hf_paged.kernels.reference_gated_delta import (  # noqa: F401  (twins of Gated DeltaNet)
    gated_delta_decode,
    gated_delta_gates,
    gated_delta_prefill,
)
from hf_paged.kernels.reference_lora import add_deltas, check_lora
from hf_paged.kernels.reference_moe import (  # noqa: F401  (twins of the MoE kernels)
    moe_experts,
    moe_route,
)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as the uint8 tensor torch's CPU copies take (they lack float8)."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches ``[N, B, Hkv, D]``.

    ``slot_mapping[t]`` is ``block_id * block_size + offset``; a negative slot skips the token
    (padding of CUDA-graph batches). An FP8 cache stores ``quantize_kv`` of them with the
    per-KV-head scales ``k_scale`` / ``v_scale``.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = key[keep], value[keep]
    if k_cache.dtype == FP8:
        key, value = quantize_kv(key, k_scale), quantize_kv(value, v_scale)
    for cache, rows in ((k_cache, key), (v_cache, value)):
        _bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, _bytes(rows))


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy cache block ``src[i]`` onto block ``dst[i]`` in both caches ``[N, B, Hkv, D]``
    (copy-on-write of blocks shared by forked sequences). No block may be both a source and a
    destination of one call: the Triton twin copies all pairs at once."""
    for cache in (_bytes(k_cache), _bytes(v_cache)):
        cache.index_copy_(0, dst, cache[src])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length queries over their paged context.

    ``query`` is ``[T, H, D]``: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``,
    which are its last tokens; ``seq_lens[b]`` counts its whole context (cached prefix plus
    these new tokens), all already stored in the cache. Query ``i`` of a sequence with ``q``
    new tokens sits at position ``seq_lens[b] - q + i`` and attends to keys ``0..position``.
    ``block_tables[b, j]`` is the cache block holding positions ``j*B .. j*B+B-1``.
    Grouped-query heads: query head ``h`` reads KV head ``h // (H // Hkv)``. An FP8 cache is
    read as ``dequantize_kv`` with the per-KV-head scales ``k_scale`` / ``v_scale``.
    """
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        blocks = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        if k_cache.dtype == FP8:
            k, v = dequantize_kv(k, k_scale, query.dtype), dequantize_kv(v, v_scale, query.dtype)
        q = query[q0:q1]
        pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        ).transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
             ) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: normalise in float32, cast back, then scale. ``offset``:
    the zero-centred norm of Qwen3-Next and Qwen3.5 (``Qwen3NextRMSNorm``), whose weight is
    stored as an offset from one: the float32 row times ``1 + weight`` in float32, then cast
    to ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in the model dtype), then ``rms_norm(residual)``.

    Returns ``(normed, residual)``; the Triton twin writes both in place of its inputs.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps, offset), residual


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """transformers' Qwen3NextRMSNormGated (Qwen3.5's is the same) over the last dimension of
    ``x`` and the gate ``z`` ``[..., D]``: ``rms_norm(x)`` (its casts), times ``silu(z)`` in
    float32, cast to ``x``'s dtype."""
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z {tuple(z.shape)} is not x's {tuple(x.shape)}")
    return (rms_norm(x, weight, eps) * F.silu(z.float())).to(x.dtype)


def rope(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half (NeoX) style, on ``[T, H, D]`` query and key.

    ``cos_sin_cache`` is ``[max_positions, R]`` float32 (``R <= D``): ``cos`` in the first half
    of the last dimension, ``sin`` in the second, each already duplicated the way
    transformers' ``cat((freqs, freqs))`` does, so ``cos = cache[p, :R//2]`` repeated twice.
    The first ``R`` dimensions of each head rotate, the rest pass (partial RoPE,
    ``partial_rotary_factor``). As in transformers, cos/sin are cast to the input dtype before
    the products.
    """
    rotary = cos_sin_cache.shape[1]
    half = rotary // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat((cs[:, :half], cs[:, :half]), -1).to(query.dtype)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), -1).to(query.dtype)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x, rest = x[..., :rotary], x[..., rotary:]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x * cos + torch.cat((-x2, x1), -1) * sin, rest), -1)

    return rotate(query), rotate(key)


def norm_rope_store(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention inputs: per-head ``rms_norm`` of query and key (``offset``: the
    zero-centred norm), ``rope`` on both (partial where the table is narrower than a head),
    and ``store_kv`` of the rotated key and the value (scaled into an FP8 cache). Returns
    ``(query, key)``; the Triton twin writes them in place of its inputs."""
    query = rms_norm(query, q_weight, eps, offset)
    key = rms_norm(key, k_weight, eps, offset)
    query, key = rope(query, key, positions, cos_sin_cache)
    store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return query, key


def embed(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int = 0,
          src: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Rows of ``weight``, a vocabulary slice from token ``vocab_start``, for tokens ``ids``
    (zeros for a token outside the slice). Where ``src >= 0`` the token is
    ``last_tokens[src]`` instead: a pending token, drawn by the previous step and still on the
    device."""
    if src is not None:
        ids = torch.where(src >= 0, last_tokens[src.clamp(min=0)], ids)
    local = ids - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, max(weight.shape[0] - 1, 0)), weight)
    return rows.masked_fill(~inside[:, None], 0)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for the merged gate/up projection output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, row_part: torch.Tensor, tiles: LoraTiles,
             norm: tuple[torch.Tensor, float] | None = None, gated: bool = False
             ) -> torch.Tensor:
    """``out`` (a projection's output ``[T, N]``) plus each row's adapter delta for the
    projection's input ``x`` (``reference_lora.add_deltas``), in place; returned. ``norm``
    (the norm's weight and eps): ``x`` is the hidden state before ``rms_norm``, the input is
    its norm, computed as the projection's was. ``gated`` (a merged gate/up projection): the
    ``silu_and_mul`` product of the sum is returned, a new tensor; ``out`` is unchanged."""
    check_lora(out, x, a, b, scaling, row_part, tiles, norm, gated)
    if gated and int(tiles.tiles[2].sum()) != out.shape[0]:
        raise ValueError(f"add_lora: gated tiles cover {int(tiles.tiles[2].sum())} rows, "
                         f"not every one of {out.shape[0]}")
    total = out.clone() if gated else out
    add_deltas(total, x if norm is None else rms_norm(x, *norm), a, b, scaling, row_part, tiles)
    return silu_and_mul(total) if gated else total


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of float32 ``logits [B, V]`` (written to ``out`` when given).

    Rows with ``temperature == 0`` are greedy (argmax, lowest index on ties, as
    ``torch.argmax``). Other rows follow transformers' warpers in its order: divide by
    temperature, keep the ``top_k`` largest (0 = off), keep the smallest set of most likely
    tokens whose probability reaches ``top_p`` (1.0 = off; at least one token kept), keep
    those at least ``min_p`` times as likely as the most likely (0 or None = off), then draw
    from the softmax of what is left.
    """
    if out is not None:
        return out.copy_(sample(logits, temperature, top_k, top_p, min_p, generator))
    greedy = logits.argmax(-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy
    rows = logits[sampled] / temperature[sampled, None]
    k, p = top_k[sampled], top_p[sampled]
    vocab = rows.shape[-1]
    sorted_logits, order = rows.sort(-1, descending=True)
    rank = torch.arange(vocab, device=rows.device)[None, :]
    remove = (rank >= k[:, None]) & (k[:, None] > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Mass of the strictly more likely tokens: a token is kept while that mass is below top_p.
    mass_above = probs.cumsum(-1) - probs
    remove = (mass_above >= p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if min_p is not None:
        probs = sorted_logits.softmax(-1)  # column 0 holds the most likely token
        remove = probs < min_p[sampled, None] * probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    choice = torch.multinomial(sorted_logits.softmax(-1), 1, generator=generator)
    out = greedy.clone()
    out[sampled] = order.gather(-1, choice).squeeze(-1)
    return out
