"""Which kernels serve the block-quantized FP8 projections, measured at start-up per projection
shape as ``projection_tuning`` measures the 16-bit ones.

An FP8 projection has these paths (``kernels.small_m``, ``kernels.fp8_gemm``): the small-M
kernel for decode's few rows, and for more rows the GEMM that dequantizes the weight tile by
tile (16-bit tensor cores), the w8a8 GEMM (the activations quantized per 128-column group, FP8
tensor cores: twice the rate, plus a quantization launch and the activations' rounding) in
Triton or, where it takes the weight, on torch's block-scaled ``F.scaled_mm`` (the same
numbers), or the whole weight dequantized into a scratch tensor for cuBLAS. For each timing
group (``projection_tuning.group_name``) start-up times, over every layer's weight of that
group in a CUDA graph: the small-M kernel against the dequantizing GEMM at 1, 2, 4 and 8 rows
(``projection_tuning.time_small_m``), which sets ``small_m_rows`` by ``small_m_rows``'s rule
without its margin; and the others at ``_GEMM_ROWS``: ``fp8_mma_choice`` picks the FP8
tensor-core GEMM (``fp8_mma``), then ``gemm_rows`` sets ``cublas_rows`` and ``w8a8_rows``.
The choice is cached on disk with the 16-bit one's (``cached_report``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.kernels.block_scales import FP8, BlockScales
from hf_paged.kernels.launch import compiling_only
from hf_paged.modeling.linear import _ParallelLinear
from hf_paged.worker.projection_tuning import (
    _micros,
    cached_report,
    group_name,
    set_choice,
    small_m_kernel,
    time_small_m,
    timed_variants,
)

logger = logging.getLogger(__name__)
_GEMM_ROWS = (16, 64, 256, 1024, 4096)
# The small-M kernel serves the rows at which it was faster than the dequantizing GEMM at all:
# both are this project's Triton kernels reading the same FP8 bytes, so no margin is kept for
# cuBLAS's sake (the 16-bit rule's). With the 16-bit rule's 10%, Qwen3-8B's gate/up projection
# at one row went to the GEMM at 43.5 us a layer against the small-M kernel's 39.8 (H100).
_SMALL_M_MARGIN = 1.0
# The most output one row count's timing graph holds: at many rows the GEMMs are bound by
# their arithmetic, and a few layers' weights time them as well as all of them.
_GRAPH_OUTPUT_BYTES = 2**29


def w8a8_rows(dequant_us: dict[int, float], w8a8_us: dict[int, float]) -> int:
    """The fewest rows from which the w8a8 GEMM was faster at every row count measured
    (0: not even at the most rows)."""
    rows = 0
    for r in sorted(dequant_us, reverse=True):
        if not w8a8_us[r] < dequant_us[r]:
            break
        rows = r
    return rows


def gemm_rows(dequant_us: dict[int, float], w8a8_us: dict[int, float],
              cublas_us: dict[int, float]) -> tuple[int, int]:
    """``(w8a8_rows, cublas_rows)``: cuBLAS over the dequantized weight from the fewest rows at
    which it was the fastest of the three at every larger count measured (0: never); below
    those, the w8a8 GEMM by ``w8a8_rows``'s rule over the counts left."""
    cublas = 0
    for r in sorted(dequant_us, reverse=True):
        if not cublas_us[r] < min(dequant_us[r], w8a8_us[r]):
            break
        cublas = r
    below = {r: us for r, us in dequant_us.items() if not cublas or r < cublas}
    return w8a8_rows(below, w8a8_us), cublas


def fp8_mma_choice(w8a8_us: dict[int, float], scaled_mm_us: dict[int, float]) -> str:
    """The ``fp8_gemm`` function that serves the FP8 tensor-core rows: ``scaled_mm_linear``
    where it was faster than ``w8a8_linear`` at more of the row counts measured than not
    (none measured: it cannot take the weight), else ``w8a8_linear``."""
    wins = sum(scaled_mm_us[r] < w8a8_us[r] for r in scaled_mm_us)
    return "scaled_mm_linear" if wins > len(scaled_mm_us) - wins else "w8a8_linear"


def scales_of(module: nn.Module) -> BlockScales | None:
    """The block scales of an FP8 projection (None for any other module)."""
    scales = getattr(module, "scales", None)
    return scales if isinstance(scales, BlockScales) else None


def tune_fp8_projections(layers: nn.Module, dtype: torch.dtype) -> dict[str, dict]:
    """Set ``small_m_rows`` (and ``norm_apart``), ``w8a8_rows``, ``cublas_rows`` and
    ``fp8_mma`` on every bias-free FP8 projection in ``layers`` (on CUDA), timed on inputs of
    the model's ``dtype``, and return, per timing group (``projection_tuning.group_name``),
    the microseconds measured and the choice."""
    groups: dict[str, list[_ParallelLinear]] = defaultdict(list)
    for module in layers.modules():
        w = module.weight if isinstance(module, _ParallelLinear) else None
        if w is not None and module.bias is None and w.is_cuda and w.dtype == FP8:
            if scales_of(module) is None:
                raise ValueError(f"an FP8 projection of shape {tuple(w.shape)} has no scales")
            groups[group_name(module, "fp8")].append(module)
    if not groups or not kernels.triton_available():
        return {}
    first = next(iter(groups.values()))[0]
    key = {"device": torch.cuda.get_device_name(first.weight.device), "dtype": str(dtype),
           "block": list(first.block),
           "shapes": {name: len(modules) for name, modules in groups.items()},
           "torch": torch.__version__, "kernel": _kernel_digest()}
    try:
        report = cached_report("fp8-projections", key, lambda: _measure(groups, dtype))
    except Exception as e:  # e.g. a GPU this Triton cannot compile FP8 for: the plain path
        logger.warning("FP8 projections stay on the dequantizing GEMM: timing failed (%s)", e)
        report = {}
    for name, modules in groups.items():
        set_choice(modules, report.get(name))
        choice = report.get(name, {})
        for m in modules:
            m.w8a8_rows, m.cublas_rows = choice.get("w8a8_rows", 0), choice.get("cublas_rows", 0)
            m.fp8_mma = choice.get("fp8_mma", "w8a8_linear")
    return report


def _kernel_digest() -> str:
    import triton

    from hf_paged.kernels import fp8_gemm, small_m
    from hf_paged.worker import projection_tuning  # its row rule and timing decide too

    text = triton.__version__.encode()
    for path in (small_m.__file__, fp8_gemm.__file__, projection_tuning.__file__, __file__):
        text += Path(path).read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def _kernels(gated: bool) -> dict[str, Callable]:
    """The kernels start-up chooses between, as ``(x, (weight, scales))`` callables (the
    small-M kernel's also takes ``projection_tuning.small_m_kernel``'s ``norm``)."""
    from hf_paged.kernels import fp8_gemm  # Triton, imported only where it runs

    small_m = small_m_kernel(gated)
    after = kernels.silu_and_mul if gated else (lambda out: out)
    return {"small_m": lambda x, w, norm=None: small_m(x, w[0], w[1], norm),
            "dequant": lambda x, w: after(fp8_gemm.dequant_linear(x, *w)),
            "w8a8": lambda x, w: after(fp8_gemm.w8a8_linear(x, *w)),
            "cublas": lambda x, w: after(fp8_gemm.cublas_linear(x, *w)),
            "scaled_mm": lambda x, w: after(fp8_gemm.scaled_mm_linear(x, *w))}


def _scaled_mm_agrees(run: dict[str, Callable], weight: tuple, dtype: torch.dtype) -> bool:
    """Whether torch's block-scaled GEMM gives the Triton w8a8 GEMM's numbers here (to 1% of
    the output's largest value: they differ by float32 accumulation order): a library or
    device that computes something else, or fails, is left out with a warning."""
    x = torch.randn(64, weight[0].shape[1], dtype=dtype, device=weight[0].device)
    try:
        got, want = run["scaled_mm"](x, weight).float(), run["w8a8"](x, weight).float()
    except RuntimeError as e:
        logger.warning("torch's block-scaled FP8 GEMM is left out: it failed (%s)", e)
        return False
    if (got - want).abs().max() <= 0.01 * want.abs().max():
        return True
    logger.warning("torch's block-scaled FP8 GEMM is left out: its output differs from the "
                   "w8a8 GEMM's")
    return False


def _measure(groups: dict[str, list[_ParallelLinear]], dtype: torch.dtype) -> dict[str, dict]:
    from hf_paged.kernels.fp8_gemm import scaled_mm_serves

    with torch.inference_mode():
        with compiling_only():  # every variant, side by side
            for name, modules in groups.items():
                w = modules[0].weight
                run, weight = _kernels("gated" in name.split()), (w, scales_of(modules[0]))
                for rows in (1, *_GEMM_ROWS):
                    x = w.new_empty(rows, w.shape[1], dtype=dtype)
                    for kernel in ("dequant", "w8a8", "cublas"):
                        run[kernel](x, weight)
                for kernel, timed in timed_variants(name, run["dequant"], run["small_m"],
                                                    x[:1]).items():
                    if kernel != "other":
                        timed(x[:1], weight)
        report = {}
        for name, modules in groups.items():
            weights = [(m.weight, scales_of(m)) for m in modules]
            run = _kernels("gated" in name.split())
            n, k = weights[0][0].shape
            times: dict[str, dict[int, float]] = {"dequant_us": {}, "w8a8_us": {},
                                                  "cublas_us": {}, "scaled_mm_us": {}}
            scaled_mm = scaled_mm_serves(*weights[0]) and _scaled_mm_agrees(run, weights[0], dtype)

            def variants_at(rows: int, name=name, run=run, k=k, device=weights[0][0].device):
                x = torch.randn(rows, k, dtype=dtype, device=device)
                return x, timed_variants(name, run["dequant"], run["small_m"], x)

            choice = time_small_m(variants_at, weights, _SMALL_M_MARGIN)
            for rows in _GEMM_ROWS:
                x = torch.randn(rows, k, dtype=dtype, device=weights[0][0].device)
                some = weights[:max(1, _GRAPH_OUTPUT_BYTES // (rows * n * x.element_size()))]
                times["dequant_us"][rows] = _micros(run["dequant"], x, some)
                times["w8a8_us"][rows] = _micros(run["w8a8"], x, some)
                times["cublas_us"][rows] = _micros(run["cublas"], x, some)
                if scaled_mm:
                    times["scaled_mm_us"][rows] = _micros(run["scaled_mm"], x, some)
            mma = fp8_mma_choice(times["w8a8_us"], times["scaled_mm_us"])
            w8a8, cublas = gemm_rows(
                times["dequant_us"],
                times["scaled_mm_us" if mma == "scaled_mm_linear" else "w8a8_us"],
                times["cublas_us"])
            report[name] = dict(gemm_us=choice.pop("other_us"), **choice, **times,
                                w8a8_rows=w8a8, cublas_rows=cublas, fp8_mma=mma)
    torch.cuda.empty_cache()  # the timing graphs' memory
    return report
