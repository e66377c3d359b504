"""Triton's interpreter, faster: before each call of a ``@triton.jit`` function (a kernel's
helpers are called many times a program) it lists every member of ``triton.language``, its
``math`` module and its tensor classes with ``inspect.getmembers`` to find the builtins it
redirects to the interpreter; that listing took half the kernel tests' time. Here each
module's or class's builtin names are listed once, and each call redirects those names that
are builtins at that moment, as Triton's own function does (identical results, 2 to 2.5
times faster programs)."""

from __future__ import annotations

import inspect


def install() -> None:
    """Replace the interpreter's ``_patch_builtin``; nothing where Triton has none."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if patch_builtin is None or patch_attr is None or is_builtin is None:
        return
    names: dict[int, list[str]] = {}

    def cached_patch_builtin(pkg, *args) -> None:
        # Modules and classes live as long as the process: their ids stay theirs. A module
        # or class is first listed by the first call that redirects it, before anything has.
        found = names.get(id(pkg))
        if found is None:
            found = names[id(pkg)] = [n for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name in found:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, *args)

    interpreter._patch_builtin = cached_patch_builtin
