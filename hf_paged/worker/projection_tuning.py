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
keeps the choice stable between runs. The choice is cached on disk (``cached_report``): only the
first start-up with a given GPU, model shape and software pays for the timings. FP8
projections are chosen for in ``fp8_tuning``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

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


def small_m_rows(cublas_us: dict[int, float], small_m_us: dict[int, float],
                 margin: float = _MARGIN) -> int:
    """The most rows up to which the small-M kernel took under ``margin`` of the other's time
    at every row count measured (the counts after its first loss may be missing: they are not
    measured)."""
    rows = 0
    for r in sorted(cublas_us):
        if r not in small_m_us or not small_m_us[r] < margin * cublas_us[r]:
            break
        rows = r
    return rows


def tune_projections(layers: nn.Module) -> dict[str, dict]:
    """Set ``small_m_rows`` on every bias-free 16-bit projection in ``layers`` (on CUDA) and
    return, per weight shape (``gated``: a merged gate/up projection, timed with its SwiGLU
    product), the microseconds measured and the rows chosen. A start-up with the same GPU,
    shapes and software reads the choice back from the cache folder (``cached_report``)."""
    groups: dict[str, list[_ParallelLinear]] = defaultdict(list)
    for module in layers.modules():
        w = module.weight if isinstance(module, _ParallelLinear) else None
        if w is not None and module.bias is None and w.is_cuda and w.element_size() == 2:
            gated = isinstance(module, MergedColumnParallelLinear)
            groups["x".join(map(str, w.shape)) + (" gated" if gated else "")].append(module)
    if not groups or not kernels.triton_available():
        return {}
    weight = next(iter(groups.values()))[0].weight
    key = {"device": torch.cuda.get_device_name(weight.device), "dtype": str(weight.dtype),
           "shapes": {name: len(modules) for name, modules in groups.items()},
           "torch": torch.__version__, "kernel": _kernel_digest()}
    try:
        report = cached_report("projections", key, lambda: _measure(groups))
    except Exception as e:  # e.g. a GPU this Triton cannot compile for: cuBLAS throughout
        logger.warning("projections stay on cuBLAS: timing the small-M kernel failed (%s)", e)
        report = {}
    for name, modules in groups.items():
        for m in modules:
            m.small_m_rows = report[name]["small_m_rows"] if name in report else 0
    return report


def cached_report(kind: str, key: dict, measure: Callable[[], dict]) -> dict:
    """``measure()``, kept as JSON in ``$HF_PAGED_CACHE_DIR`` (default ``~/.cache/hf_paged``)
    under a name made from ``key``, and read back from there when a file of that name is
    present. A cache that cannot be written is skipped."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(os.environ.get("HF_PAGED_CACHE_DIR") or Path.home() / ".cache" / "hf_paged")
    path = folder / f"{kind}-{digest}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads(path.read_text())["report"]
    report = measure()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")  # ranks may write it at once
        temporary.write_text(json.dumps({"key": key, "report": report}, indent=1))
        temporary.replace(path)
    except OSError as e:
        logger.info("start-up's measurements are not cached: %s", e)
    return report


def _kernel_digest() -> str:
    """A digest of Triton's version, the small-M kernel's source and this file: a changed
    compiler, kernel or rule invalidates cached choices."""
    import triton

    from hf_paged.kernels import small_m

    text = triton.__version__.encode() + Path(small_m.__file__).read_bytes()
    return hashlib.sha256(text + Path(__file__).read_bytes()).hexdigest()[:16]


def _measure(groups: dict[str, list[_ParallelLinear]]) -> dict[str, dict]:
    from hf_paged.kernels import small_m  # Triton, imported only where it runs

    def kernels_for(gated: bool) -> tuple[Callable, Callable]:
        if gated:
            return kernels.gated_linear, small_m.gated_linear  # cuBLAS + silu_and_mul, or ours
        return F.linear, small_m.linear

    with torch.inference_mode():
        with compiling_only():  # each shape's variant, side by side
            for name, modules in groups.items():
                w = modules[0].weight
                kernels_for(name.endswith("gated"))[1](w.new_empty(1, w.shape[1]), w)
        report = {}
        for name, modules in groups.items():
            weights = [m.weight for m in modules]
            theirs, ours = kernels_for(name.endswith("gated"))
            cublas, mine = {}, {}
            for rows in _ROWS:  # up to the small-M kernel's first loss
                x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype,
                                device=weights[0].device)
                cublas[rows] = _micros(theirs, x, weights)
                mine[rows] = _micros(ours, x, weights)
                if small_m_rows(cublas, mine) < rows:
                    break
            report[name] = dict(cublas_us=cublas, small_m_us=mine,
                                small_m_rows=small_m_rows(cublas, mine))
    torch.cuda.empty_cache()  # the timing graphs' memory
    return report


def _micros(projection: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``projection(x, w)``, over every weight, replayed from a CUDA graph
    (ten replays: timing noise otherwise flips close choices between runs)."""

    def step():
        for w in weights:
            projection(x, w)

    return graph_micros(step, replays=10) / len(weights)
