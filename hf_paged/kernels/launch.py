"""Launching the Triton kernels, or only compiling them.

A fresh machine compiles each kernel variant (Triton specialises on constants, dtypes and
argument alignment) the first time a step needs it, one after another: most of a first
start-up. Inside ``compiling_only`` a launch compiles its variant on a thread pool instead
of running it (Triton's compiler releases the GIL, so variants compile side by side), and
leaving the block waits for them all. The runner steps through every warm-up and graph shape
that way first, then runs them for real on compiled kernels.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

_compile_only = False


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or inside ``compiling_only`` its compilation."""
    if _compile_only:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def compiling_only(workers: int | None = None) -> Iterator[None]:
    """Launches inside compile their kernels on ``workers`` threads (default: this process's
    CPUs) and run nothing; every compilation has ended when the block exits. Kernels'
    outputs are left unwritten: only shapes count inside."""
    from triton.runtime._async_compile import AsyncCompileMode

    global _compile_only
    workers = workers or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
        _compile_only = True
        try:
            yield
        finally:
            _compile_only = False


def hash_triton_in_background() -> None:
    """Triton hashes its own sources and library (about 0.3 s) the first time a process
    compiles or loads a kernel. Start that on a thread, where reading and hashing the library
    release the GIL, so that it overlaps what start-up does first (loading the weights)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # where older Triton versions keep it
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return
    threading.Thread(target=triton_key, name="triton-key", daemon=True).start()
