"""The mixture-of-experts kernels against their twins: routing (softmax, top-k, renormalised),
the alignment of (token, slot) pairs into expert blocks, and the grouped gate/up and down
GEMMs, over batches from one token to several alignment chunks, few and many experts hit, an
expert every token picks and one none does, k = 1 and expert counts that are no power of two;
the twin against stock transformers and a dense computation; and on a GPU, a CUDA graph
captured once and replayed with new routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.moe_gemm import moe_experts
from hf_paged.kernels.moe_routing import max_slots, moe_align, moe_route
from hf_paged.kernels.moe_tiles import MoEConfig, moe_config
from tests.kernels.conftest import DEVICE, HALF, assert_close

# (tokens, experts, top_k, hidden, intermediate)
SHAPES = [
    (1, 8, 2, 64, 32),  # decode: two experts of eight hit
    (5, 6, 2, 48, 40),  # experts no power of two, sizes that fill no tile evenly
    (7, 4, 1, 32, 16),  # k = 1
    (40, 8, 4, 64, 48),  # 160 pairs: two alignment chunks
]


def rand(*shape, dtype):
    return (torch.randn(*shape, device=DEVICE) / shape[-1] ** 0.5).to(dtype)


def distinct_logits(tokens: int, experts: int, dtype) -> torch.Tensor:
    """Random logits without ties in a row (exact in half precision too), so the top-k is
    unambiguous."""
    ranks = torch.stack([torch.randperm(experts) for _ in range(tokens)]).float()
    return ((ranks - experts / 2) / 16).to(device=DEVICE, dtype=dtype)


def routing(tokens: int, experts: int, top_k: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and ids where every token picks expert 0 and none the last expert."""
    ids = [[0, *(torch.randperm(experts - 2)[: top_k - 1] + 1).tolist()] for _ in range(tokens)]
    ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1).to(dtype)
    return weights, ids


def expert_weights(experts: int, hidden: int, inter: int, dtype):
    return rand(experts, 2 * inter, hidden, dtype=dtype), rand(experts, hidden, inter, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (6, 128, 8), (3, 60, 4), (4, 5, 1)])
def test_route(dtype, renormalize, tokens, experts, top_k):
    logits = distinct_logits(tokens, experts, dtype)
    weights, ids = moe_route(logits, top_k, renormalize)
    want_weights, want_ids = reference.moe_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == dtype
    assert torch.equal(ids, want_ids)
    # exp differs by an ulp or so between Triton and torch (the GPU's is approximate)
    tol = max(torch.finfo(dtype).eps, 1e-5)
    torch.testing.assert_close(weights, want_weights, rtol=tol, atol=tol)


def test_route_breaks_ties_to_the_lowest_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0] * 5], device=DEVICE)
    weights, ids = moe_route(logits, 2, False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights[:, 0], weights[:, 1])


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 6, 2), (40, 8, 4), (70, 3, 2)])
def test_align(block_m, tokens, experts, top_k):
    """Every pair once, in order within its expert's group; each group padded with the
    sentinel to whole blocks that name its expert; the experts in index order."""
    _, ids = routing(tokens, experts, top_k, torch.float32)
    sorted_pairs, block_expert, used = moe_align(ids, experts, block_m)
    pairs = tokens * top_k
    assert sorted_pairs.numel() == max_slots(tokens, top_k, experts, block_m)
    counts = torch.bincount(ids.flatten().long(), minlength=experts).tolist()
    padded = [-(-n // block_m) * block_m for n in counts]
    assert used.tolist() == [sum(padded)]
    layout, blocks = sorted_pairs[: sum(padded)].tolist(), block_expert.tolist()
    flat = ids.flatten().tolist()
    start = 0
    for expert, (n, size) in enumerate(zip(counts, padded)):
        group = layout[start: start + size]
        assert group[:n] == [p for p in range(pairs) if flat[p] == expert]
        assert group[n:] == [pairs] * (size - n)
        assert blocks[start // block_m: (start + size) // block_m] == [expert] * (size // block_m)
        start += size


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", SHAPES)
def test_experts(dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    x = rand(tokens, hidden, dtype=dtype)
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    weights, ids = routing(tokens, experts, top_k, dtype)
    assert_close(moe_experts(x, w13, w2, weights, ids),
                 reference.moe_experts(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", SHAPES)
def test_pairs_of_another_ranks_experts_add_nothing(dtype, shape):
    """Expert parallelism: a pair of expert -1 (held by another rank) has no slot in the
    layout and adds nothing to its token (a token with none left sums to zero)."""
    tokens, experts, top_k, hidden, inter = shape
    x = rand(tokens, hidden, dtype=dtype)
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    weights, ids = routing(tokens, experts, top_k, dtype)
    ids = torch.where(ids % 2 == 1, -1, ids).contiguous()  # the odd experts are elsewhere
    assert_close(moe_experts(x, w13, w2, weights, ids),
                 reference.moe_experts(x, w13, w2, weights, ids))
    sorted_pairs, _, used = moe_align(ids, experts, 16)
    kept = {p for p, e in enumerate(ids.flatten().tolist()) if e >= 0}
    assert set(sorted_pairs[: int(used)].tolist()) - {ids.numel()} == kept


def test_routed_end_to_end_with_int64_ids_and_a_given_config():
    """The router's output fed to the experts (ids as transformers' int64 too), with tiles
    other than the default: larger M blocks, several steps along K and N."""
    tokens, experts, top_k, hidden, inter = 9, 12, 3, 96, 80
    x = rand(tokens, hidden, dtype=HALF)
    w13, w2 = expert_weights(experts, hidden, inter, HALF)
    weights, ids = moe_route(rand(tokens, experts, dtype=HALF), top_k, True)
    want = reference.moe_experts(x, w13, w2, weights, ids)
    config = MoEConfig(block_m=32, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
    for given in (ids, ids.long()):
        assert_close(moe_experts(x, w13, w2, weights, given, config=config), want)


def test_unused_experts_weights_are_not_read():
    """NaN in the weights of every expert no token picks leaves the output finite."""
    tokens, experts, top_k, hidden, inter = 3, 16, 2, 64, 32
    x = rand(tokens, hidden, dtype=HALF)
    w13, w2 = expert_weights(experts, hidden, inter, HALF)
    weights, ids = routing(tokens, experts, top_k, HALF)
    want = moe_experts(x, w13, w2, weights, ids)
    unused = sorted(set(range(experts)) - set(ids.flatten().tolist()))
    w13[unused], w2[unused] = float("nan"), float("nan")
    assert torch.equal(moe_experts(x, w13, w2, weights, ids), want)


def test_reference_matches_transformers_exactly():
    tokens, experts, top_k, hidden, inter = 6, 8, 3, 32, 24
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                            num_experts=experts, num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    torch.nn.init.normal_(module.gate_up_proj, std=0.2)
    torch.nn.init.normal_(module.down_proj, std=0.2)
    x = torch.randn(tokens, hidden)
    weights, ids = reference.moe_route(torch.randn(tokens, experts), top_k, True)
    with torch.no_grad():
        want = module(x, ids.long(), weights)
    got = reference.moe_experts(x, module.gate_up_proj.data, module.down_proj.data, weights, ids)
    assert torch.equal(got, want)


def test_reference_matches_a_dense_computation():
    """Every expert on every token in float64, masked by the routing."""
    tokens, experts, top_k, hidden, inter = 5, 6, 2, 16, 12
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64)
    w2 = torch.randn(experts, hidden, inter, dtype=torch.float64)
    weights, ids = reference.moe_route(torch.randn(tokens, experts, dtype=torch.float64),
                                       top_k, False)
    gate, up = torch.einsum("th,eih->tei", x, w13).chunk(2, dim=-1)
    every = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)
    mask = torch.zeros(tokens, experts, dtype=torch.float64)
    mask.scatter_(1, ids.long(), weights)
    torch.testing.assert_close(reference.moe_experts(x, w13, w2, weights, ids),
                               (every * mask[..., None]).sum(1))


def test_config_tiers():
    """M tiles of 16 for decode, larger as rows per expert grow; tiles fit small models."""
    def block_m(tokens):
        return moe_config(tokens, 128, 8, 768, 2048, torch.bfloat16).block_m

    assert [block_m(t) for t in (1, 16, 64, 256, 2048, 8192)] == [16, 16, 16, 32, 128, 128]
    small = moe_config(4, 8, 2, 24, 32, torch.float32)
    assert small.block_n <= 32 and small.block_k <= 32


def test_dispatch_takes_the_twins_on_cpu_tensors(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", False)
    logits = torch.randn(3, 8)
    weights, ids = kernels.moe_route(logits, 2, True)
    x, (w13, w2) = torch.randn(3, 16), expert_weights(8, 16, 8, torch.float32)
    w13, w2 = w13.cpu(), w2.cpu()
    assert torch.equal(kernels.moe_experts(x, w13, w2, weights, ids),
                       reference.moe_experts(x, w13, w2, weights, ids))


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_routing():
    """Captured once at a batch, replayed after the routing changes: no host sync, no
    shapes that depend on the routing."""
    tokens, experts, top_k, hidden, inter = 40, 128, 8, 256, 128  # 320 pairs: 3 chunks
    dtype = torch.bfloat16
    x = rand(tokens, hidden, dtype=dtype)
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    logits = distinct_logits(tokens, experts, dtype)

    def step():
        weights, ids = moe_route(logits, top_k, True)
        return weights, ids, moe_experts(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, out = step()
    for _ in range(3):
        logits.copy_(distinct_logits(tokens, experts, dtype))
        x.copy_(rand(tokens, hidden, dtype=dtype))
        graph.replay()
        assert torch.equal(ids, reference.moe_route(logits, top_k, True)[1])
        assert_close(out, reference.moe_experts(x, w13, w2, weights, ids))
