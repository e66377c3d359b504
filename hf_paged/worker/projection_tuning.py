"""Which projections run the small-M kernel at decode's small batches, measured at start-up.

cuBLAS's kernel choice for a one-row GEMM is good for most shapes and poor for some (on an
H200, Qwen3-0.6B's o_proj took 12.6 us at one row against the small-M kernel's 5.9; for its
other projections and all of the 8B's, cuBLAS was faster). So for each projection shape, on
the GPU and weights it will run with, start-up times both at 1, 2, 4 and 8 rows: a CUDA graph
of the projection over every layer's weight of that shape (so the weights stream from memory
as in a real step, not from L2), timed on replay. The small-M kernel then serves up to the
most rows at which it took under ``_MARGIN`` of cuBLAS's time at every row count up to there;
the margin keeps the choice stable between runs.
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
from hf_paged.modeling.linear import _ParallelLinear

logger = logging.getLogger(__name__)
_ROWS = (1, 2, 4, 8)
_MARGIN = 0.9


def small_m_rows(cublas_us: dict[int, float], small_m_us: dict[int, float]) -> int:
    """The most rows up to which the small-M kernel won at every row count measured."""
    rows = 0
    for r in sorted(cublas_us):
        if not small_m_us[r] < _MARGIN * cublas_us[r]:
            break
        rows = r
    return rows


def tune_projections(layers: nn.Module) -> dict[str, dict]:
    """Set ``small_m_rows`` on every bias-free 16-bit projection in ``layers`` (on CUDA) and
    return, per weight shape, the microseconds measured and the rows chosen."""
    groups: dict[tuple[int, int], list[_ParallelLinear]] = defaultdict(list)
    for module in layers.modules():
        w = module.weight if isinstance(module, _ParallelLinear) else None
        if w is not None and module.bias is None and w.is_cuda and w.element_size() == 2:
            groups[tuple(w.shape)].append(module)
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


def _tune(groups: dict[tuple[int, int], list[_ParallelLinear]]) -> dict[str, dict]:
    from hf_paged.kernels import small_m  # Triton, imported only where it runs

    some = next(iter(groups.values()))[0].weight
    with torch.inference_mode():
        with compiling_only():  # its two variants (Triton sets one row apart) side by side
            for rows in (1, 2):
                small_m.linear(some.new_empty(rows, some.shape[1]), some)
        report = {}
        for (n, k), modules in groups.items():
            weights = [m.weight for m in modules]
            cublas, mine = {}, {}
            for rows in _ROWS:
                x = torch.randn(rows, k, dtype=some.dtype, device=some.device)
                cublas[rows] = _micros(F.linear, x, weights)
                mine[rows] = _micros(small_m.linear, x, weights)
            chosen = small_m_rows(cublas, mine)
            for m in modules:
                m.small_m_rows = chosen
            report[f"{n}x{k}"] = dict(cublas_us=cublas, small_m_us=mine, small_m_rows=chosen)
    torch.cuda.empty_cache()  # the timing graphs' memory
    return report


def _micros(projection: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``projection(x, w)``, over every weight, replayed from a CUDA graph."""

    def step():
        for w in weights:
            projection(x, w)

    return graph_micros(step) / len(weights)
