"""Which projections run the small-M kernel at decode's small batches, measured at start-up.

At one row cuBLAS's kernels were slower than the small-M kernel on every Qwen3-0.6B projection
measured on an H200 (o_proj: 12.6 us against 3.6); at more rows the small-M kernel reads the
weight once per row (from L2 after the first) and loses on the wide ones. So for each projection
shape, on the GPU and weights it will run with, start-up times both at 1, 2, 4 and 8 rows
(stopping at the small-M kernel's first loss): a CUDA graph of the projection over every layer's
weight of that shape (so the weights stream from memory as in a real step, not from L2), timed
on replay. The merged gate/up projection is timed with its SwiGLU product: the gated small-M
kernel against cuBLAS then ``silu_and_mul``. A projection the model calls after an RMSNorm the
small-M kernel takes in (``fuses_norm``: Qwen3's qkv and gate/up) is timed so: the kernel with
the norm and residual add fused, against ``add_rms_norm`` then cuBLAS (on an H100 the fused norm
added 2 us a layer to Qwen3-8B's FP8 qkv and 7 to its gate/up at one row, each program
normalising its own copy of the row). The LM head is timed as one more projection (one row:
390 us against cuBLAS's 436 at Qwen3-8B's width, H100). The small-M kernel then serves up to
the most rows at which it took under ``_MARGIN`` of cuBLAS's time at every row count up to
there; the margin keeps the choice stable between runs. The choice is cached on disk
(``cached_report``): only the first start-up with a given GPU, model shape and software pays
for the timings. FP8 projections are chosen for in ``fp8_tuning``.
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
from hf_paged.modeling.embedding import ParallelLMHead
from hf_paged.modeling.linear import MergedColumnParallelLinear, _ParallelLinear

logger = logging.getLogger(__name__)
_ROWS = (1, 2, 4, 8)
_MARGIN = 0.9
_EPS = 1e-6  # the timed norms' epsilon (any: it does not change the work)


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


def group_name(module: nn.Module, kind: str = "") -> str:
    """The timing group of a projection: its weight's shape, then ``kind`` (``fp8``), ``gated``
    (a merged gate/up projection, timed with its SwiGLU product), ``normed`` (timed with the
    RMSNorm fused in) or ``lm_head``."""
    words = ["x".join(map(str, module.weight.shape)), kind]
    if isinstance(module, ParallelLMHead):
        words.append("lm_head")
    else:
        words.append("gated" if isinstance(module, MergedColumnParallelLinear) else "")
        words.append("normed" if getattr(module, "fuses_norm", False) else "")
    return " ".join(w for w in words if w)


def tune_projections(layers: nn.Module, lm_head: nn.Module | None = None) -> dict[str, dict]:
    """Set ``small_m_rows`` on every bias-free 16-bit projection in ``layers`` and on
    ``lm_head`` (on CUDA) and return, per timing group (``group_name``), the microseconds
    measured and the rows chosen. A start-up with the same GPU, shapes and software reads the
    choice back from the cache folder (``cached_report``)."""
    groups: dict[str, list[nn.Module]] = defaultdict(list)
    for module in [*layers.modules(), *([lm_head] if lm_head is not None else [])]:
        w = module.weight if isinstance(module, (_ParallelLinear, ParallelLMHead)) else None
        if (w is not None and getattr(module, "bias", None) is None and w.is_cuda
                and w.element_size() == 2):
            groups[group_name(module)].append(module)
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
        set_choice(modules, report.get(name))
    return report


def timed_variants(name: str, theirs: Callable, ours: Callable, x: torch.Tensor
                   ) -> dict[str, Callable]:
    """The kernels start-up times for group ``name`` at ``x``'s rows, as ``(x, w)`` callables
    computing what the model computes there: ``other`` (``theirs``) and ``small_m`` (``ours``,
    a small-M kernel, its gated form for a gated group). For a ``normed`` group ``other`` runs
    after ``add_rms_norm`` of ``x`` and a residual, ``small_m`` has that norm fused in (``ours``
    must then take ``small_m_kernel``'s ``norm``), and ``small_m_apart`` is the norm's own
    launch then the small-M kernel."""
    if "normed" not in name.split():
        return {"other": theirs, "small_m": ours}
    residual = torch.randn_like(x)
    norm = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)

    def after_norm(projection: Callable) -> Callable:
        return lambda x, w: projection(kernels.add_rms_norm(x, residual, norm, _EPS)[0], w)

    return {"other": after_norm(theirs),
            "small_m": lambda x, w: ours(x, w, norm=(residual, norm, _EPS)),
            "small_m_apart": after_norm(ours)}


def time_small_m(variants_at: Callable[[int], tuple[torch.Tensor, dict[str, Callable]]],
                 weights: list, margin: float = _MARGIN) -> dict:
    """Time ``variants_at(rows)``'s ``(x, timed_variants)`` over ``weights`` at 1, 2, 4 and 8
    rows, up to the small-M kernel's first loss, and choose its rows by ``small_m_rows`` with
    ``margin``. A normed group's two small-M variants are both timed at one row, and the
    faster serves (``norm_apart``: the norm's own launch then the kernel; on an H100 the norm
    fused into Qwen3-8B's FP8 gate/up kernel cost 7 us a layer, more than a launch)."""
    other: dict[int, float] = {}
    mine: dict[int, float] = {}
    report, apart = {}, False
    for rows in _ROWS:
        x, run = variants_at(rows)
        other[rows] = _micros(run["other"], x, weights)
        if rows == 1 and "small_m_apart" in run:
            fused = _micros(run["small_m"], x, weights)
            unfused = _micros(run["small_m_apart"], x, weights)
            report.update(small_m_fused_us=fused, small_m_apart_us=unfused)
            apart = unfused < fused
            mine[rows] = min(fused, unfused)
        else:
            mine[rows] = _micros(run["small_m_apart" if apart else "small_m"], x, weights)
        if small_m_rows(other, mine, margin) < rows:
            break
    return dict(report, other_us=other, small_m_us=mine,
                small_m_rows=small_m_rows(other, mine, margin), norm_apart=apart)


def set_choice(modules: list[nn.Module], choice: dict | None) -> None:
    """Start-up's choice (None: none was measured) onto each module of a timing group."""
    for m in modules:
        m.small_m_rows = choice["small_m_rows"] if choice else 0
        if getattr(m, "fuses_norm", False):
            m.norm_apart = bool(choice and choice.get("norm_apart"))


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


def small_m_kernel(gated: bool) -> Callable:
    """The small-M kernel as ``(x, w, scales=None, norm=None)``; ``norm``: ``(residual,
    weight, eps)`` of an RMSNorm fused in."""
    from hf_paged.kernels import small_m  # Triton, imported only where it runs

    def run(x: torch.Tensor, w: torch.Tensor, scales=None, norm=None) -> torch.Tensor:
        if norm is not None:
            return small_m.normed_linear(x, norm[0], norm[1], norm[2], w, gated, scales)[0]
        return (small_m.gated_linear if gated else small_m.linear)(x, w, scales)

    return run


def timed_kernels(name: str, x: torch.Tensor) -> dict[str, Callable]:
    """``timed_variants`` of a 16-bit group: cuBLAS (then ``silu_and_mul`` for a gated group)
    against the small-M kernel."""
    gated = "gated" in name.split()
    theirs = kernels.gated_linear if gated else F.linear
    return timed_variants(name, theirs, small_m_kernel(gated), x)


def _measure(groups: dict[str, list[nn.Module]]) -> dict[str, dict]:
    with torch.inference_mode():
        with compiling_only():  # each shape's variants, side by side
            for name, modules in groups.items():
                w = modules[0].weight
                x = w.new_empty(1, w.shape[1])
                for kernel, run in timed_kernels(name, x).items():
                    if kernel != "other":
                        run(x, w)
        report = {}
        for name, modules in groups.items():
            weights = [m.weight for m in modules]

            def variants_at(rows: int, name=name, w=weights[0]):
                x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
                return x, timed_kernels(name, x)

            choice = time_small_m(variants_at, weights)
            report[name] = dict(cublas_us=choice.pop("other_us"), **choice)
    torch.cuda.empty_cache()  # the timing graphs' memory
    return report


def _micros(projection: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``projection(x, w)``, over every weight, replayed from a CUDA graph
    (ten replays: timing noise otherwise flips close choices between runs)."""

    def step():
        for w in weights:
            projection(x, w)

    return graph_micros(step, replays=10) / len(weights)
