from __future__ import annotations

import importlib
import types
from pathlib import Path

import torch

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.modeling.attention import attention_function
from tests.kernels.conftest import DEVICE


def test_no_kernel_module_shadows_a_dispatcher():
    """Importing ``hf_paged.kernels.X`` binds X on the package: no module may share a
    dispatcher's name."""
    for path in Path(kernels.__file__).parent.glob("[!_]*.py"):
        importlib.import_module(f"hf_paged.kernels.{path.stem}")
    for name in kernels.__all__:  # dispatchers, and BlockScales (a class)
        assert not isinstance(getattr(kernels, name), types.ModuleType), name


def test_routes_by_device_and_switch(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_kernel", lambda module, name: lambda *args: "triton")
    x, weight = torch.randn(3, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", False)
    assert (kernels.rms_norm(x, weight, 1e-6) == "triton") is (DEVICE.type == "cuda")
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    assert kernels.rms_norm(x, weight, 1e-6) == "triton"


def test_sdpa_backend_drops_the_triton_hints():
    query = torch.randn(2, 2, 8)
    cache = torch.randn(4, 8, 1, 8)
    cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 9], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    args = query, cache, cache, cu, lens, tables, 0.5
    out = attention_function("sdpa")(*args, max_query_len=1, shared_prefix=torch.tensor([8]))
    torch.testing.assert_close(out, reference.paged_attention(*args))
