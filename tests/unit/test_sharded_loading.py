"""Tensor-parallel weight loaders: the shards of every rank put back together give the
checkpoint tensor (heads stay whole, merged projections keep their parts apart, KV heads are
replicated when there are fewer than ranks), and a head count the ranks cannot split is
refused naming both numbers."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from hf_paged.families import check_model
from hf_paged.families.build import build_model
from hf_paged.modeling.embedding import VocabParallelEmbedding
from hf_paged.modeling.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from hf_paged.modeling.tp import TensorParallel
from tests.conftest import TINY_CONFIGS

TP = 2


def shards(make, load, tp_size=TP):
    mods = [make(TensorParallel(rank, tp_size)) for rank in range(tp_size)]
    for m in mods:
        load(m)
    return [m.weight.data for m in mods]


def load_qkv(q, k, v):
    def load(m):
        for sid, w in zip("qkv", (q, k, v)):
            m.weight_loader(m.weight, w, sid)
    return load


def test_qkv_shards_hold_whole_heads():
    hidden, d, heads, kv = 16, 4, 4, 2
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv, kv))
    parts = shards(lambda tp: QKVParallelLinear(hidden, d, heads, kv, tp=tp), load_qkv(q, k, v))
    for rank, w in enumerate(parts):
        qs, ks, vs = w.split([heads * d // TP, kv * d // TP, kv * d // TP])
        assert torch.equal(qs, q.chunk(TP)[rank])
        assert torch.equal(ks, k.chunk(TP)[rank]) and torch.equal(vs, v.chunk(TP)[rank])


def test_fewer_kv_heads_than_ranks_are_replicated():
    """8 query heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 head 1."""
    hidden, d, heads, kv, size = 16, 4, 8, 2, 4
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv, kv))
    parts = shards(lambda tp: QKVParallelLinear(hidden, d, heads, kv, tp=tp), load_qkv(q, k, v),
                   tp_size=size)
    for rank, w in enumerate(parts):
        qs, ks, vs = w.split([2 * d, d, d])
        assert torch.equal(qs, q.chunk(size)[rank])
        assert torch.equal(ks, k.chunk(kv)[rank // 2]) and torch.equal(vs, v.chunk(kv)[rank // 2])


@pytest.mark.parametrize("heads, kv, inter, size, message", [
    (6, 2, 128, 4, r"num_attention_heads \(6\) is not divisible by tensor_parallel_size \(4\)"),
    (8, 6, 128, 4, r"num_key_value_heads \(6\) is not divisible by tensor_parallel_size \(4\)"),
    (12, 2, 96, 3, r"tensor_parallel_size \(3\) is not a multiple of num_key_value_heads \(2\)"),
    (8, 2, 90, 4, r"intermediate_size \(90\) is not divisible by tensor_parallel_size \(4\)"),
])
def test_unsplittable_shapes_name_both_numbers(heads, kv, inter, size, message):
    config = Qwen3Config(num_attention_heads=heads, num_key_value_heads=kv,
                         intermediate_size=inter, head_dim=8)
    with pytest.raises(ValueError, match=message):
        check_model(config, size)


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


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_each_rank_loads_its_slices_of_a_checkpoint(checkpoints, hf_models, name):
    """Built as rank r of 2 (loading needs no process group), every swapped parameter is
    rank r's slice of transformers' tensor."""
    hf = dict(hf_models[name].named_parameters())
    config = hf_models[name].config
    per_rank = [dict(build_model(config, checkpoints[name], torch.float32, torch.device("cpu"),
                                 "sdpa", 64, TensorParallel(r, TP)).hf_model.named_parameters())
                for r in range(TP)]
    layer = "model.layers.1."
    qkv = [p[layer + "self_attn.qkv_proj.weight"] for p in per_rank]
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for rank, w in enumerate(qkv):
        q, k, v = w.split([heads * d // TP, kv * d // TP, kv * d // TP])
        for part, proj in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
            assert torch.equal(part, hf[layer + f"self_attn.{proj}.weight"].chunk(TP)[rank])
    for key, dim in (("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):
        full = torch.cat([p[layer + key] for p in per_rank], dim)
        assert torch.equal(full, hf[layer + key])
    embed = torch.cat([p["model.embed_tokens.weight"] for p in per_rank])
    assert torch.equal(embed, hf["model.embed_tokens.weight"])
    assert torch.equal(per_rank[1][layer + "input_layernorm.weight"],
                       hf[layer + "input_layernorm.weight"])
    assert TINY_CONFIGS[name]["vocab_size"] == embed.shape[0]

