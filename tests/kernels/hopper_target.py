"""Compiling the Triton kernels for an H100 (sm_90) on a machine without a GPU.

Triton's interpreter, which the other kernel tests run on the CPU, accepts code that its
compiler refuses (a constexpr branch returning another type than the code after it, an early
return inside one). ``compile_for_hopper(cases)`` makes Triton's active driver one that names
an sm_90 target and launches nothing, then calls each case inside ``launch.compiling_only``:
every launch compiles its variant to a cubin (outputs stay unwritten), as start-up's
compile-ahead does on a GPU. Run it in a subprocess with ``TRITON_INTERPRET=0`` and
``HF_PAGED_TRITON_ON_CPU=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver

from hf_paged.kernels.launch import compiling_only


class HopperTarget(DriverBase):
    """Triton's driver interface as compilation reads it: an sm_90 device, stream 0."""

    def __init__(self) -> None:
        pass

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing runs on a compile-only target")

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError("nothing runs on a compile-only target")

    def clear_cache(self, cache) -> None:
        pass

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("nothing runs on a compile-only target")


def compile_for_hopper(cases: Iterable[Callable[[], object]]) -> None:
    """Compile every kernel variant ``cases`` launch, for sm_90; raises the first error."""
    driver.set_active(HopperTarget())
    with compiling_only():
        for case in cases:
            case()
