"""The flash_attn backend's adapter, against a stand-in for flash-attn that follows its
documented contract (varlen queries, paged K/V through ``block_table``, causal mask aligned to
the bottom right): the adapter must hand it what reproduces ``reference.paged_attention``.
flash-attn itself is exercised by the GPU parity test wherever it is installed."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hf_paged.kernels import flash_attn as adapter
from hf_paged.kernels import reference
from tests.kernels.test_paged_attention import paged_batch


def varlen_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    softmax_scale, causal, block_table):
    assert causal and cu_seqlens_k.dtype == torch.int32 and block_table.dtype == torch.int32
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert max_seqlen_q >= max(q_lens) and max_seqlen_k >= max(k_lens)
    group = q.shape[1] // k.shape[2]
    out = torch.zeros_like(q)
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        keys = k[block_table[b].long()].flatten(0, 1)[:nk].repeat_interleave(group, 1)
        values = v[block_table[b].long()].flatten(0, 1)[:nk].repeat_interleave(group, 1)
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b]) + nq)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys.float()) * softmax_scale
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
    return out


@pytest.fixture
def stand_in(monkeypatch):
    module = types.SimpleNamespace(flash_attn_varlen_func=varlen_stand_in)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    adapter._varlen_func.cache_clear()
    yield
    adapter._varlen_func.cache_clear()


def test_adapter_maps_the_paged_batch_onto_flash_attn(stand_in):
    seq_lens, q_lens = [40, 9, 75, 33], [13, 1, 70, 1]  # chunks after a cached prefix, decodes
    query, k_cache, v_cache, cu, lens, tables = [
        t.cpu() for t in paged_batch(seq_lens, q_lens, 8, 2, 16, 16, torch.float32)]
    out = adapter.paged_attention(query, k_cache, v_cache, cu, lens, tables, 0.25,
                                  max_query_len=max(q_lens))
    expected = reference.paged_attention(query, k_cache, v_cache, cu, lens, tables, 0.25)
    torch.testing.assert_close(out, expected)
