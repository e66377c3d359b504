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


def _small_m(x: torch.Tensor, weight: torch.Tensor, bias, small_m_rows: int) -> bool:
    """Whether the small-M kernel serves this projection: at most ``small_m_rows`` rows (which
    start-up sets per projection where it measured the kernel faster), no bias, one dtype."""
    return bool(small_m_rows and x.dim() == 2 and x.shape[0] <= small_m_rows and bias is None
                and _use_triton(x) and x.dtype == weight.dtype
                and x.stride(1) == weight.stride(1) == 1)


def _plain(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales | None) -> torch.Tensor:
    """The weight as ``F.linear`` takes it: a block-quantized one dequantized to ``x``'s dtype
    (the reference path of the FP8 projections)."""
    return weight if scales is None else dequantize(weight, scales, x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           small_m_rows: int = 0, scales: BlockScales | None = None) -> torch.Tensor:
    """``F.linear``, or the small-M Triton kernel where ``_small_m`` says. ``scales``: the
    weight is block-quantized FP8 (``kernels.block_scales``)."""
    if scales is not None:
        return F.linear(x, _plain(x, weight, scales), bias)
    if _small_m(x, weight, bias, small_m_rows):
        return _triton_kernel("small_m", "linear")(x, weight)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, small_m_rows: int = 0,
                 scales: BlockScales | None = None) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight))`` for a merged gate/up ``weight``; where
    ``_small_m`` says, one small-M kernel computes both."""
    if scales is None and _small_m(x, weight, None, small_m_rows):
        return _triton_kernel("small_m", "gated_linear")(x, weight)
    return silu_and_mul(F.linear(x, _plain(x, weight, scales)))


def normed_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, small_m_rows: int = 0,
    gated: bool = False, scales: BlockScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection (``gated``: ``gated_linear``) of ``rms_norm(x + residual)``, and
    ``x + residual`` (``x`` when ``residual`` is None), as ``add_rms_norm`` then the
    projection compute them; where ``_small_m`` says, one small-M kernel does it all."""
    if (scales is None and _small_m(x, weight, bias, small_m_rows)
            and norm_weight.dtype == x.dtype
            and (residual is None or residual.stride(1) == 1)):
        return _triton_kernel("small_m", "normed_linear")(x, residual, norm_weight, eps, weight,
                                                          gated)
    if residual is None:
        x, residual = rms_norm(x, norm_weight, eps), x
    else:
        x, residual = add_rms_norm(x, residual, norm_weight, eps)
    if gated:
        return gated_linear(x, weight, small_m_rows, scales), residual
    return linear(x, weight, bias, small_m_rows, scales), residual


copy_blocks = _dispatch("block_copy", "copy_blocks")
norm_rope_store = _dispatch("attention_inputs", "norm_rope_store")
rms_norm = _dispatch("rmsnorm", "rms_norm")
add_rms_norm = _dispatch("rmsnorm", "add_rms_norm")
silu_and_mul = _dispatch("activation", "silu_and_mul")
embed = _dispatch("embedding", "embed")
sample = _dispatch("sampling", "sample")
moe_route = _dispatch("moe_routing", "moe_route")
moe_experts = _dispatch("moe_gemm", "moe_experts")

__all__ = [
    "BlockScales", "add_rms_norm", "copy_blocks", "gated_linear", "linear", "moe_experts",
    "moe_route", "norm_rope_store", "normed_linear", "rms_norm", "sample", "silu_and_mul",
]
