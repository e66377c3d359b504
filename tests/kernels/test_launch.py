"""Kernel launches, and inside ``compiling_only`` their compilation alone (the kernels
themselves are compiled for real only on CUDA machines: the start-up GPU tests)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

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
