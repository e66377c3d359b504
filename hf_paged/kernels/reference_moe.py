"""Plain-torch twins of the mixture-of-experts kernels (routing and the experts' grouped
GEMMs), as transformers' Qwen3-MoE modules compute them (``reference`` re-exports them beside
every other twin)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels.block_scales import BlockScales, dequantize


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3-MoE router after its projection: the softmax of ``router_logits
    [T, E]`` in float32, the ``top_k`` largest (``torch.topk``: descending), renormalised to
    sum to one when ``renormalize`` (``norm_topk_prob``), cast to the logits' dtype.
    Returns ``(weights [T, k], ids [T, k] int32)``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, config: object | None = None,
                w13_scales: BlockScales | None = None, w2_scales: BlockScales | None = None,
                ) -> torch.Tensor:
    """transformers' Qwen3MoeExperts: token ``t`` of ``x [T, H]`` goes through its experts
    ``ids[t]`` (distinct in a row; -1: another rank's expert, which adds nothing), each
    ``F.linear(silu(gate) * up, w2[e])`` with ``gate, up`` the halves of
    ``F.linear(x[t], w13[e])``, times ``weights[t, slot]``, summed.

    ``w13 [E, 2I, H]`` holds an expert's gate rows then its up rows and ``w2 [E, H, I]`` its
    down projection; under tensor parallelism, a rank's slices of both. As transformers, the
    experts are taken in index order, each over its (slot, token) pairs in that order, and
    added up with ``index_add_`` in ``x``'s dtype, so float32 results match it bit for bit.
    ``config`` (the Triton twin's tiles) is ignored. ``w13_scales`` / ``w2_scales``: the
    weights are block-quantized FP8, each expert dequantized to ``x``'s dtype before use (as
    transformers dequantizes them when it loads them)."""
    out = torch.zeros_like(x)
    ids = ids.long()
    inter = w2.shape[-1]
    for expert in ids.unique().tolist():
        if expert < 0:  # another rank's expert (expert parallelism): the pair adds nothing
            continue
        slot, token = torch.where(ids.T == expert)
        hidden = F.linear(x[token], _expert(w13, w13_scales, expert, x.dtype))
        hidden = F.silu(hidden[:, :inter]) * hidden[:, inter:]
        hidden = F.linear(hidden, _expert(w2, w2_scales, expert, x.dtype))
        hidden = hidden * weights[token, slot, None]
        out.index_add_(0, token, hidden.to(x.dtype))
    return out


def _expert(w: torch.Tensor, scales: BlockScales | None, expert: int, dtype: torch.dtype
            ) -> torch.Tensor:
    """Expert ``expert``'s matrix of ``w``, dequantized when ``scales`` are given."""
    if scales is None:
        return w[expert]
    return dequantize(w[expert], scales._replace(inv=scales.inv[expert]), dtype)
