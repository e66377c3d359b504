"""The kernels' GPU variants compile for an H100 (sm_90) on this machine: the FP8 paths (FP8
weights in the small-M kernel, both block-scaled GEMMs, the whole weight's dequantization, FP8
experts; an FP8 KV cache in the store and in decode, split decode, cascade and prefill
attention) and their 16-bit twins; the LoRA kernels at decode and prefill; RMSNorm (blocks
of rows per head, and with the residual add); the Gated DeltaNet layers' convolution
(prefill, decode), gated RMSNorm, and chunked prefill and decode (Qwen3-Next's heads).
The interpreter runs their arithmetic in the other tests; this catches what only the compiler
refuses. (``hopper_target`` says how.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels.attention import paged_attention
from hf_paged.kernels.attention_inputs import norm_rope_store
from hf_paged.kernels.block_scales import BlockScales, grid_rows
from hf_paged.kernels.lora_tiles import LoraTiles
from tests.kernels.conftest import DEVICE

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _fp8_weight(parts: list[int], k: int) -> tuple[torch.Tensor, BlockScales]:
    rows = grid_rows(parts, 128)
    weight = torch.randn(sum(parts), k).to(FP8)
    return weight, BlockScales(torch.rand(int(rows[-1]) + 1, -(-k // 128)), rows, 128)


def projections() -> None:
    x1, x64 = torch.randn(3, 1024, dtype=BF16), torch.randn(64, 1024, dtype=BF16)
    w, s = _fp8_weight([2048, 1024, 1024], 1024)
    gate_up, gs = _fp8_weight([3072, 3072], 1024)
    norm = torch.ones(1024, dtype=BF16)
    for scales, weight, gated in ((s, w, gate_up), (None, w.to(BF16), gate_up.to(BF16))):
        g = gs if scales is not None else None
        kernels.linear(x1, weight, None, 8, scales)
        kernels.gated_linear(x1, gated, 8, g)
        kernels.normed_linear(x1, x1.clone(), norm, 1e-6, weight, None, 8, False, scales)
        kernels.normed_linear(x1, x1.clone(), norm, 1e-6, gated, None, 8, True, g)
    for w8a8_rows in (0, 16):  # dequantize-in-the-tile, then w8a8
        kernels.linear(x64, w, None, 8, s, w8a8_rows=w8a8_rows)
    kernels.linear(x64, w, None, 8, s, cublas_rows=16)  # the weight dequantized for cuBLAS


def experts() -> None:
    num_experts, hidden, inter, top_k = 8, 512, 384, 2
    w13, s13 = _fp8_weight([inter, inter], hidden)
    w2, s2 = _fp8_weight([hidden], inter)
    w13 = w13.expand(num_experts, -1, -1).contiguous()
    w2 = w2.expand(num_experts, -1, -1).contiguous()
    s13 = s13._replace(inv=s13.inv.expand(num_experts, -1, -1).contiguous())
    s2 = s2._replace(inv=s2.inv.expand(num_experts, -1, -1).contiguous())
    for tokens in (1, 64):
        x = torch.randn(tokens, hidden, dtype=BF16)
        weights = torch.rand(tokens, top_k, dtype=BF16)
        ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int()
        kernels.moe_experts(x, w13, w2, weights, ids, None, s13, s2)
        kernels.moe_experts(x, w13.to(BF16), w2.to(BF16), weights, ids)


def attention() -> None:
    heads, kv_heads, head_dim, page, blocks = 16, 8, 128, 64, 12
    for cache_dtype in (FP8, BF16):
        scales = (torch.rand(kv_heads), torch.rand(kv_heads)) if cache_dtype == FP8 else (None,) * 2
        caches = [torch.zeros(blocks, page, kv_heads, head_dim).to(cache_dtype) for _ in "kv"]
        qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, dtype=BF16)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        norm = torch.ones(head_dim, dtype=BF16)
        cos_sin = torch.randn(4096, head_dim, dtype=torch.float32)
        norm_rope_store(q.view(5, heads, head_dim), k.view(5, kv_heads, head_dim),
                        v.view(5, kv_heads, head_dim), norm, norm, 1e-6,
                        torch.arange(5), cos_sin, *caches, torch.arange(5), *scales)
        lens = torch.tensor([100, 300, 700], dtype=torch.int32)
        tables = torch.arange(blocks, dtype=torch.int32).view(3, 4)
        decode_q = torch.randn(3, heads, head_dim, dtype=BF16)
        cu = torch.arange(4, dtype=torch.int32)
        for splits in (1, 3):
            paged_attention(decode_q, *caches, cu, lens, tables, 0.1, max_query_len=1,
                            num_splits=splits, k_scale=scales[0], v_scale=scales[1])
        paged_attention(decode_q, *caches, cu, lens, tables, 0.1, max_query_len=1, num_splits=2,
                        shared_prefix=torch.tensor([64], dtype=torch.int32),
                        k_scale=scales[0], v_scale=scales[1])
        prefill_q = torch.randn(40, heads, head_dim, dtype=BF16)
        cu = torch.tensor([0, 20, 30, 40], dtype=torch.int32)
        paged_attention(prefill_q, *caches, cu, lens, tables, 0.1, max_query_len=20,
                        k_scale=scales[0], v_scale=scales[1])


def lora() -> None:
    adapters, hidden = 4, 1024
    for dtype in (BF16, torch.float16):
        norm = (torch.ones(hidden, dtype=dtype), 1e-6)
        for lens, slots, rank in (([1] * 8, [0, -1, 1, 1, 2, 3, 0, -1], 16),  # decode
                                  ([300, 20, 7], [2, -1, 0], 128)):  # prefill
            tokens = sum(lens)
            tiles = LoraTiles.build(lens, slots, torch.device("cpu"))
            x = torch.randn(tokens, hidden, dtype=dtype)
            for parts, variants in (([2048, 1024, 1024], ((None, False), (norm, False))),
                                    ([3072, 3072], ((norm, True),))):  # qkv; gate/up
                row_part = torch.repeat_interleave(torch.arange(len(parts)),
                                                   torch.tensor(parts)).int()
                for normed, gated in variants:
                    kernels.add_lora(torch.randn(tokens, sum(parts), dtype=dtype), x,
                                     torch.randn(adapters, len(parts) * rank, hidden,
                                                 dtype=dtype),
                                     torch.randn(adapters, sum(parts), rank, dtype=dtype),
                                     torch.rand(adapters, len(parts)), row_part, tiles,
                                     normed, gated)


def norms() -> None:
    # Qwen3's per-head q norm on its heads of the fused qkv output (rows of 128, a block of rows
    # a program), and the hidden norm with its residual add (a row of 4,096 a program).
    qkv = torch.randn(5, 48, 128, dtype=BF16)
    kernels.rms_norm(qkv[:, :32], torch.ones(128, dtype=BF16), 1e-6)
    x, residual = torch.randn(2, 5, 4096, dtype=BF16)
    for offset in (False, True):
        kernels.add_rms_norm(x, residual, torch.ones(4096, dtype=BF16), 1e-6, offset)


def conv_and_gated_norm() -> None:
    # Qwen3-Next's mixed q/k/v channels; transformers' state width (kernel_size) and the
    # smallest (kernel_size - 1); new and continued sequences, a padding slot.
    channels, width, lens = 8192, 4, [300, 20, 1]
    weight = torch.randn(channels, width, dtype=BF16)
    cu = torch.tensor([0, *lens]).cumsum(0).int()
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    for state_len in (width, width - 1):
        pool = torch.zeros(4, channels, state_len, dtype=BF16)
        x = torch.randn(sum(lens), channels, dtype=BF16)
        kernels.causal_conv_prefill(x, weight, None, cu, pool, slots,
                                    torch.tensor([True, False, True]))
        kernels.causal_conv_decode(x[:3], weight, weight[:, 0], pool, slots)
    x, z = torch.randn(2, 5, 16, 128, dtype=BF16)  # the attention output, its gate, per head
    for weight in (torch.ones(128, dtype=BF16), torch.ones(128)):
        kernels.gated_rms_norm(x, z, weight, 1e-6)


def gated_delta() -> None:
    kv_heads, heads, dim, slots = 16, 32, 128, 4
    state_pool = torch.zeros(slots, heads, dim, dim)
    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32)
    for tokens in (200, 3):  # prefill, decode
        q, k = (torch.randn(tokens, kv_heads, dim, dtype=BF16) for _ in "qk")
        v = torch.randn(tokens, heads, dim, dtype=BF16)
        fused = torch.randn(tokens, 2 * heads + 3, dtype=BF16)  # b and a, views of one projection
        g, beta = kernels.gated_delta_gates(fused[:, 3 + heads:], fused[:, 3:3 + heads],
                                            torch.rand(heads), torch.rand(heads, dtype=BF16))
        slot_ids = torch.tensor([2, 0, 3], dtype=torch.int32)
        if tokens == 3:
            kernels.gated_delta_decode(q, k, v, g, beta, state_pool, slot_ids)
        else:
            kernels.gated_delta_prefill(q, k, v, g, beta, cu, state_pool, slot_ids,
                                        torch.tensor([True, False, True]))


def compile_all() -> None:
    from tests.kernels.hopper_target import compile_for_hopper

    compile_for_hopper([projections, experts, attention, lora, norms, conv_and_gated_norm,
                        gated_delta])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU compiles and runs the kernels itself")
def test_kernels_compile_for_hopper():
    env = dict(os.environ, TRITON_INTERPRET="0", HF_PAGED_TRITON_ON_CPU="1")
    done = subprocess.run(
        [sys.executable, "-c", "from tests.kernels.test_compile_hopper import compile_all; "
         "compile_all()"], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
