"""The engine with every op it can send to Triton sent there (the interpreter, on CPU): the
kernels as the model wires them (the fused norms and activation, the small-M projections of
decode rows, and the Triton attention backend, whose decode kernel computes the newest
token's norm, RoPE and cache store itself) give the tokens of the plain-torch path."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import kernels
from hf_paged.kernels.small_m import MAX_ROWS
from hf_paged.modeling.embedding import ParallelLMHead
from hf_paged.modeling.linear import _ParallelLinear
from tests.conftest import left_padded


def kernel_and_twin_tokens(monkeypatch, path: str, dtype: torch.dtype, small_m: bool = False,
                           norm_apart: bool = False, **options
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of three prompts through the Triton kernels (interpreter), then through the
    plain-torch twins; ``small_m`` sends every projection (the LM head too) of decode rows to
    the small-M kernel, as start-up may choose on a GPU (``norm_apart``: after the norm's own
    launch rather than with the norm fused in, as it also may); ``options``: engine options."""
    ids, mask = left_padded([5, 9, 3], 1024, seed=4)

    def tokens(through_triton: bool) -> torch.Tensor:
        monkeypatch.setattr(kernels, "_TRITON_ON_CPU", through_triton)
        backend = "triton" if through_triton else "sdpa"
        with hf_paged.from_pretrained(path, device="cpu", dtype=dtype,
                                      attention_backend=backend, **options) as engine:
            for module in engine.model.hf_model.modules() if small_m else ():
                if isinstance(module, (_ParallelLinear, ParallelLMHead)):
                    module.small_m_rows = MAX_ROWS
                    if getattr(module, "fuses_norm", False):
                        module.norm_apart = norm_apart
            return engine.generate(ids, attention_mask=mask, max_new_tokens=6)

    return tokens(True), tokens(False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
@pytest.mark.parametrize("norm_apart", [False, True])
def test_decode_through_the_kernels_gives_the_reference_tokens(checkpoints, monkeypatch,
                                                               norm_apart):
    triton_tokens, twin_tokens = kernel_and_twin_tokens(
        monkeypatch, checkpoints["gqa4_untied"], torch.float16, small_m=True,
        norm_apart=norm_apart)
    assert torch.equal(triton_tokens, twin_tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
def test_a_qwen3_moe_engine_on_the_kernels_gives_the_reference_tokens(moe_checkpoints,
                                                                      monkeypatch):
    """The fused MoE kernels (routing, alignment, grouped GEMMs) as the sparse blocks wire
    them, in prefill and decode steps, float32: the twins' tokens."""
    triton_tokens, twin_tokens = kernel_and_twin_tokens(
        monkeypatch, moe_checkpoints["e6_k3_raw_dense0"], torch.float32)
    assert torch.equal(triton_tokens, twin_tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
def test_an_fp8_kv_cache_on_the_kernels_gives_the_reference_tokens(checkpoints, monkeypatch):
    """The FP8 cache's store, prefill and decode reads (split and not) and the calibration
    prefill through the kernels, float32: the twins' tokens."""
    triton_tokens, twin_tokens = kernel_and_twin_tokens(
        monkeypatch, checkpoints["gqa_tied"], torch.float32, kv_cache_dtype="fp8")
    assert torch.equal(triton_tokens, twin_tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
@pytest.mark.parametrize("name", ["cut_200_300", "moe_cut_160"])
def test_fp8_weights_on_the_kernels_give_the_reference_tokens(fp8_checkpoints, monkeypatch,
                                                              name):
    """FP8 weights as the model wires them: the small-M kernel reading FP8 for decode rows
    (plain, gated and normed), the dequantize-in-the-tile GEMM for prefill, FP8 experts in the
    grouped GEMMs; dimensions cut short of a block and merged parts whose grids do not line
    up; float32: the twins' tokens. (Not 16 bits: the small-M kernel never rounds the
    dequantized weight to the activations' dtype, as the plain path does, so there the two
    differ by that rounding; ``test_fp8_linear`` holds each kernel to its twin in 16 bits.)"""
    triton_tokens, twin_tokens = kernel_and_twin_tokens(
        monkeypatch, fp8_checkpoints[name], torch.float32, small_m=True)
    assert torch.equal(triton_tokens, twin_tokens)
