"""Which projections run the small-M kernel at decode's small batches, measured at start-up.

At one row cuBLAS's kernels were slower than the small-M kernel on every Qwen3-0.6B projection
measured on an H200 (o_proj: 12.6 us against 3.6); at more rows the small-M kernel reads the
weight once per row (from L2 after the first) and loses on the wide ones. So for each projection
shape, on the GPU and weights it will run with, start-up times both at 1, 2, 4 and 8 rows
(stopping at the small-M kernel's first loss): a CUDA graph of the projection over every layer's
weight of that shape (so the weights stream from memory as in a real step, not from L2), timed
on replay. The merged gate/up projection is timed with its SwiGLU product: the gated small-M
kernel against cuBLAS then ``silu_and_mul``. The small-M kernel then serves up to the most rows
at which it took under ``_MARGIN`` of cuBLAS's time at every row count up to there; the margin
keeps the choice stable between runs.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged import kernels
from hf_paged.cuda_graphs import graph_micros
from hf_paged.kernels.launch import compiling_only
from hf_paged.modeling.linear import MergedColumnParallelLinear, _ParallelLinear

logger = logging.getLogger(__name__)
_ROWS = (1, 2, 4, 8)
_MARGIN = 0.9


def small_m_rows(cublas_us: dict[int, float], small_m_us: dict[int, float]) -> int:
    """The most rows up to which the small-M kernel won at every row count measured (the
    counts after its first loss may be missing: they are not measured)."""
    rows = 0
    for r in sorted(cublas_us):
        if r not in small_m_us or not small_m_us[r] < _MARGIN * cublas_us[r]:
            break
        rows = r
    return rows


def tune_projections(layers: nn.Module) -> dict[str, dict]:
    """Set ``small_m_rows`` on every bias-free 16-bit projection in ``layers`` (on CUDA) and
    return, per weight shape (``gated``: a merged gate/up projection, timed with its SwiGLU
    product), the microseconds measured and the rows chosen."""
    groups: dict[tuple[int, int, bool], list[_ParallelLinear]] = defaultdict(list)
    for module in layers.modules():
        w = module.weight if isinstance(module, _ParallelLinear) else None
        if w is not None and module.bias is None and w.is_cuda and w.element_size() == 2:
            gated = isinstance(module, MergedColumnParallelLinear)
            groups[(*w.shape, gated)].append(module)
    if not groups or not kernels.triton_available():
        return {}
    try:
        return _tune(groups)
    except Exception as e:  # e.g. a GPU this Triton cannot compile for: cuBLAS throughout
        logger.warning("projections stay on cuBLAS: timing the small-M kernel failed (%s)", e)
        for modules in groups.values():
            for m in modules:
                m.small_m_rows = 0
        return {}


def _tune(groups: dict[tuple[int, int, bool], list[_ParallelLinear]]) -> dict[str, dict]:
    from hf_paged.kernels import small_m  # Triton, imported only where it runs

    def kernels_for(gated: bool) -> tuple[Callable, Callable]:
        if gated:
            return (lambda x, w: kernels.silu_and_mul(F.linear(x, w))), small_m.gated_linear
        return F.linear, small_m.linear

    with torch.inference_mode():
        with compiling_only():  # each shape's variant, side by side
            for (_, _, gated), modules in groups.items():
                w = modules[0].weight
                kernels_for(gated)[1](w.new_empty(1, w.shape[1]), w)
        report = {}
        for (n, k, gated), modules in groups.items():
            weights = [m.weight for m in modules]
            theirs, ours = kernels_for(gated)
            cublas, mine = {}, {}
            for rows in _ROWS:  # up to the small-M kernel's first loss
                x = torch.randn(rows, k, dtype=weights[0].dtype, device=weights[0].device)
                cublas[rows] = _micros(theirs, x, weights)
                mine[rows] = _micros(ours, x, weights)
                if small_m_rows(cublas, mine) < rows:
                    break
            chosen = small_m_rows(cublas, mine)
            for m in modules:
                m.small_m_rows = chosen
            name = f"{n}x{k}" + (" gated" if gated else "")
            report[name] = dict(cublas_us=cublas, small_m_us=mine, small_m_rows=chosen)
    torch.cuda.empty_cache()  # the timing graphs' memory
    return report


def _micros(projection: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``projection(x, w)``, over every weight, replayed from a CUDA graph
    (ten replays: timing noise otherwise flips close choices between runs)."""

    def step():
        for w in weights:
            projection(x, w)

    return graph_micros(step, replays=10) / len(weights)
