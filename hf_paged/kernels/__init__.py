"""Kernel dispatch: the Triton kernels for CUDA tensors, the plain-torch reference otherwise.
Attention is chosen by the engine's ``attention_backend`` instead (``modeling.attention``).

``HF_PAGED_TRITON_ON_CPU=1`` sends CPU tensors to Triton too (for tests under
``TRITON_INTERPRET=1``). Kernel modules, and Triton with them, are imported on first use: the
package imports without Triton, and ``TRITON_INTERPRET`` may be set after it is imported.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch
import torch.nn.functional as F

from hf_paged.kernels import reference
from hf_paged.kernels.block_scales import BlockScales, dequantize

_HAS_TRITON = importlib.util.find_spec("triton") is not None
# Decode attention starts its programs in the given order (longest context first) from this many
# sequences; below it they all start at once, or nearly, and the order's load and grid would
# only delay them (batch-1 decode is latency-bound).
ORDERED_MIN_SEQS = 16
_TRITON_ON_CPU = os.environ.get("HF_PAGED_TRITON_ON_CPU") == "1"


def triton_available() -> bool:
    return _HAS_TRITON


def triton_on(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device``: CUDA, or CPU under ``HF_PAGED_TRITON_ON_CPU``
    (Triton's interpreter)."""
    return _HAS_TRITON and (device.type == "cuda" or _TRITON_ON_CPU)


def _use_triton(tensor: torch.Tensor) -> bool:
    return triton_on(tensor.device)


@functools.cache
def _triton_kernel(module: str, name: str):
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def _dispatch(module: str, name: str):
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def run(*args, **kwargs):
        fn = _triton_kernel(module, name) if _use_triton(args[0]) else ref
        return fn(*args, **kwargs)

    return run


def _small_m(x: torch.Tensor, weight: torch.Tensor, bias, small_m_rows: int,
             scales: BlockScales | None = None) -> bool:
    """Whether the small-M kernel serves this projection: at most ``small_m_rows`` rows (which
    start-up sets per projection where it measured the kernel faster), no bias, one dtype (or
    a block-quantized FP8 weight)."""
    return bool(small_m_rows and x.dim() == 2 and x.shape[0] <= small_m_rows and bias is None
                and _use_triton(x) and (x.dtype == weight.dtype or scales is not None)
                and x.stride(1) == weight.stride(1) == 1)


def _plain(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales | None) -> torch.Tensor:
    """The weight as ``F.linear`` takes it: a block-quantized one dequantized to ``x``'s dtype
    (the reference path of the FP8 projections)."""
    return weight if scales is None else dequantize(weight, scales, x.dtype)


def _fp8_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              scales: BlockScales, w8a8_rows: int, cublas_rows: int, fp8_mma: str
              ) -> torch.Tensor:
    """A block-quantized projection of any number of rows (start-up's choice per shape,
    ``worker/fp8_tuning.py``): from ``cublas_rows`` rows on (0: never) the weight dequantized
    whole, then cuBLAS; below that, from ``w8a8_rows`` rows on (0: never) FP8 activations on
    the FP8 tensor cores (``fp8_mma``: the ``fp8_gemm`` function that serves them); else the
    weight dequantized tile by tile in a Triton GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    name = ("cublas_linear" if cublas_rows and m >= cublas_rows else
            fp8_mma if w8a8_rows and m >= w8a8_rows else "dequant_linear")
    out = _triton_kernel("fp8_gemm", name)(rows, weight, scales, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           small_m_rows: int = 0, scales: BlockScales | None = None,
           w8a8_rows: int = 0, cublas_rows: int = 0, fp8_mma: str = "w8a8_linear"
           ) -> torch.Tensor:
    """``F.linear``, or the small-M Triton kernel where ``_small_m`` says. ``scales``: the
    weight is block-quantized FP8 (``kernels.block_scales``); Triton reads it as FP8 (the
    small-M kernel, else ``_fp8_gemm`` by ``w8a8_rows``, ``cublas_rows`` and ``fp8_mma``), the
    plain path dequantizes it."""
    if _small_m(x, weight, bias, small_m_rows, scales):
        return _triton_kernel("small_m", "linear")(x, weight, scales)
    if scales is not None and _use_triton(x):
        return _fp8_gemm(x, weight, bias, scales, w8a8_rows, cublas_rows, fp8_mma)
    return F.linear(x, _plain(x, weight, scales), bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, small_m_rows: int = 0,
                 scales: BlockScales | None = None, w8a8_rows: int = 0,
                 cublas_rows: int = 0, fp8_mma: str = "w8a8_linear") -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight))`` for a merged gate/up ``weight``; where
    ``_small_m`` says, one small-M kernel computes both."""
    if _small_m(x, weight, None, small_m_rows, scales):
        return _triton_kernel("small_m", "gated_linear")(x, weight, scales)
    return silu_and_mul(linear(x, weight, None, 0, scales, w8a8_rows, cublas_rows, fp8_mma))


def normed_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, small_m_rows: int = 0,
    gated: bool = False, scales: BlockScales | None = None, w8a8_rows: int = 0,
    offset: bool = False, cublas_rows: int = 0, fuse: bool = True,
    fp8_mma: str = "w8a8_linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection (``gated``: ``gated_linear``) of ``rms_norm(x + residual)`` (``offset``:
    the zero-centred norm), and ``x + residual`` (``x`` when ``residual`` is None), as
    ``add_rms_norm`` then the projection compute them; where ``_small_m`` says (and the norm is
    Qwen3's), one small-M kernel does it all, unless not ``fuse`` (start-up measured the
    norm's own launch then the small-M kernel faster)."""
    if (fuse and not offset and _small_m(x, weight, bias, small_m_rows, scales)
            and norm_weight.dtype == x.dtype and (residual is None or residual.stride(1) == 1)):
        return _triton_kernel("small_m", "normed_linear")(x, residual, norm_weight, eps, weight,
                                                          gated, scales)
    if residual is None:
        x, residual = rms_norm(x, norm_weight, eps, offset=offset), x
    else:
        x, residual = add_rms_norm(x, residual, norm_weight, eps, offset=offset)
    if gated:
        return (gated_linear(x, weight, small_m_rows, scales, w8a8_rows, cublas_rows, fp8_mma),
                residual)
    return linear(x, weight, bias, small_m_rows, scales, w8a8_rows, cublas_rows, fp8_mma), residual


copy_blocks = _dispatch("block_copy", "copy_blocks")
norm_rope_store = _dispatch("attention_inputs", "norm_rope_store")
rms_norm = _dispatch("rmsnorm", "rms_norm")
add_rms_norm = _dispatch("rmsnorm", "add_rms_norm")
gated_rms_norm = _dispatch("gated_norm", "gated_rms_norm")
silu_and_mul = _dispatch("activation", "silu_and_mul")
embed = _dispatch("embedding", "embed")
sample = _dispatch("sampling", "sample")
moe_route = _dispatch("moe_routing", "moe_route")
moe_experts = _dispatch("moe_gemm", "moe_experts")
add_lora = _dispatch("lora", "add_lora")
causal_conv_prefill = _dispatch("causal_conv", "causal_conv_prefill")
causal_conv_decode = _dispatch("causal_conv", "causal_conv_decode")
gated_delta_prefill = _dispatch("gated_delta_chunked", "gated_delta_prefill")
gated_delta_decode = _dispatch("gated_delta", "gated_delta_decode")
gated_delta_gates = _dispatch("delta_gates", "gated_delta_gates")

__all__ = [
    "BlockScales", "add_lora", "add_rms_norm", "causal_conv_decode", "causal_conv_prefill",
    "copy_blocks", "gated_delta_decode", "gated_delta_gates", "gated_delta_prefill", "gated_linear",
    "gated_rms_norm", "linear", "moe_experts", "moe_route", "norm_rope_store", "normed_linear",
    "rms_norm", "sample", "silu_and_mul",
]
