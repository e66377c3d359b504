"""Kernel launches, and inside ``compiling_only`` their compilation alone (the kernels
themselves are compiled for real only on CUDA machines: the start-up GPU tests)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hf_paged.kernels.gdc import pdl_options  # noqa: E402
from hf_paged.kernels.launch import compiling_only, launch  # noqa: E402


class Kernel:
    """Stands in for a Triton kernel: records launches and compile-only launches."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("run", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))


def test_launches_run_outside_and_only_compile_inside_compiling_only():
    kernel = Kernel()
    launch(kernel, (4,), 1, 2, BLOCK=16)
    with compiling_only(workers=2):
        launch(kernel, (8, 2), 3, BLOCK=32, num_warps=4)
    launch(kernel, (1,), 5)
    assert kernel.calls == [("run", (4,), (1, 2), {"BLOCK": 16}),
                            ("compile", (8, 2), (3,), {"BLOCK": 32, "num_warps": 4}),
                            ("run", (1,), (5,), {})]


def test_an_error_inside_compiling_only_leaves_launches_running():
    kernel = Kernel()
    with pytest.raises(RuntimeError), compiling_only(workers=1):
        raise RuntimeError("a step failed")
    launch(kernel, (1,), 0)
    assert kernel.calls == [("run", (1,), (0,), {})]


def test_no_dependent_launch_off_hopper():
    """CPU tensors (Triton's interpreter) never launch dependently: it has no grid
    dependency control."""
    assert pdl_options(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


def test_every_dependently_launched_kernel_waits():
    """A kernel launched with ``launch_pdl`` that read or wrote before waiting for the previous
    kernel would race it: each kernel taking ``PDL`` calls ``wait_for_previous(PDL)``."""
    import importlib
    import inspect
    import pkgutil

    import hf_paged.kernels as package

    kernels = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        # Triton's jit functions, or the interpreter's stand-ins for them
        kernels += [fn for name, fn in vars(module).items()
                    if "PDL" in getattr(fn, "arg_names", ()) and name != "wait_for_previous"]
    assert len(kernels) >= 6
    for fn in kernels:
        assert "wait_for_previous(PDL)" in inspect.getsource(fn.fn), fn.fn.__name__
