"""Kernel tests: the Triton kernels against ``kernels.reference``, on the GPU when there is one,
else on CPU tensors through Triton's interpreter (switched on in ``tests/__init__.py``, before
anything imports Triton)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter mishandles bfloat16 (matrix products, rounding): float16 stands in.
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """``torch.empty`` hands out NaN-filled float tensors, so unwritten outputs show up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tolerances by dtype: float32 to 1e-4 relative, half precision to 1e-2; never NaN."""
    tol = 1e-4 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
