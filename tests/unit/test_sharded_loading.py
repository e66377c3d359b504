"""Tensor-parallel weight loaders: the shards of every rank put back together give the
checkpoint tensor (heads stay whole, merged projections keep their parts apart)."""

from __future__ import annotations

import torch

from hf_paged.modeling.embedding import VocabParallelEmbedding
from hf_paged.modeling.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

TP = 2


def shards(make, load):
    mods = [make((rank, TP)) for rank in range(TP)]
    for m in mods:
        load(m)
    return [m.weight.data for m in mods]


def test_qkv_shards_hold_whole_heads():
    hidden, d, heads, kv = 16, 4, 4, 2
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv, kv))

    def load(m):
        for sid, w in zip("qkv", (q, k, v)):
            m.weight_loader(m.weight, w, sid)

    parts = shards(lambda tp: QKVParallelLinear(hidden, d, heads, kv, tp=tp), load)
    for rank, w in enumerate(parts):
        qs, ks, vs = w.split([heads * d // TP, kv * d // TP, kv * d // TP])
        assert torch.equal(qs, q.chunk(TP)[rank])
        assert torch.equal(ks, k.chunk(TP)[rank]) and torch.equal(vs, v.chunk(TP)[rank])


def test_gate_up_and_row_parallel():
    gate, up = torch.randn(12, 8), torch.randn(12, 8)

    def load(m):
        m.weight_loader(m.weight, gate, 0)
        m.weight_loader(m.weight, up, 1)

    for rank, w in enumerate(shards(lambda tp: MergedColumnParallelLinear(8, [12, 12], tp=tp),
                                    load)):
        assert torch.equal(w, torch.cat([gate.chunk(TP)[rank], up.chunk(TP)[rank]]))
    down = torch.randn(8, 12)
    parts = shards(lambda tp: RowParallelLinear(12, 8, tp=tp),
                   lambda m: m.weight_loader(m.weight, down))
    assert torch.equal(torch.cat(parts, dim=1), down)


def test_vocab_shards_cover_the_vocabulary():
    table = torch.randn(11, 4)  # not divisible by TP: the last shard is shorter
    parts = shards(lambda tp: VocabParallelEmbedding(11, 4, tp=tp),
                   lambda m: m.weight_loader(m.weight, table))
    assert torch.equal(torch.cat(parts), table)
