"""`hf-paged run` and `hf-paged serve`: a script, a module or an installed console command
(transformers serve among them) run unchanged with transformers patched; and the one-line form
every command gives an error in."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Callable
from functools import partial

from hf_paged.lora.named import AdapterSpecError

RUN_USAGE = """\
usage: hf-paged run [--engine-option KEY=VALUE ...] SCRIPT [ARGS...]
       hf-paged run [--engine-option KEY=VALUE ...] -m MODULE [ARGS...]
       hf-paged run [--engine-option KEY=VALUE ...] COMMAND [ARGS...]

Run a Python script, a module (as python -m does) or an installed console command (e.g.
transformers, lm_eval) unchanged, with transformers patched so that Qwen3 checkpoints load on
hf_paged. --engine-option sets an engine option for every model it loads (a Python literal
value: max_model_len=4096, enforce_eager=True)."""


def front(command: str, argv: list[str]) -> int:
    """``run`` and ``serve``: patch transformers, then hand over to the script or command. Bad
    hf-paged arguments are one error line; the script's or command's own exceptions and exit
    statuses propagate as they would without hf-paged."""
    import hf_paged
    from hf_paged.integrations import serve

    try:
        options, rest = serve.take_engine_options(argv, anywhere=command == "serve")
        if command == "serve":
            if any(a in ("-h", "--help") for a in rest):
                print(serve.SERVE_HELP)
            else:
                serve.check_serve_extras()
            start = serve.serve_command(rest)
            adapters = sum(a == "--lora" or a.startswith("--lora=") for a in rest)
            if adapters:  # their slots reserved before the KV cache is sized, all held
                options.setdefault("enable_lora", True)
                options.setdefault("max_loras", max(adapters, 4))
        elif not rest or rest[0] in ("-h", "--help"):
            print(RUN_USAGE, file=sys.stdout if rest else sys.stderr)
            return 0 if rest else 2
        else:
            start = _run_target(rest)
        hf_paged.patch_transformers(**options)
    except (ValueError, TypeError, LookupError, ImportError) as error:
        print(f"error: {command}: {one_line(error)}", file=sys.stderr)
        return 2
    try:
        return start()
    except AdapterSpecError as error:  # found as the model loads, before serving
        print(f"error: {command}: {one_line(error)}", file=sys.stderr)
        return 2


def _run_target(argv: list[str]) -> Callable[[], int]:
    """What runs ``SCRIPT``, ``-m MODULE`` or ``COMMAND`` with the arguments after it, as
    ``__main__``, as ``python SCRIPT``, ``python -m MODULE`` or the command's executable
    would."""
    from hf_paged.integrations.serve import console_command, run_console_command

    target, args = argv[0], argv[1:]
    if target == "-m":
        if not args:
            raise ValueError("-m needs a module name")
        if not _module_exists(args[0]):
            raise LookupError(f"no module named {args[0]!r}")
        return partial(_run_module, args[0], args[1:])
    if os.path.isfile(target):
        return partial(_run_script, target, args)
    if console_command(target) is not None:
        return partial(run_console_command, target, args)
    raise LookupError(f"no such script or console command {target!r}")


def _module_exists(name: str) -> bool:
    sys.path.insert(0, os.getcwd())  # where python -m looks first
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False
    finally:
        sys.path.pop(0)


def _run_script(script: str, args: list[str]) -> int:
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def _run_module(module: str, args: list[str]) -> int:
    sys.argv = [module, *args]  # runpy puts the module's file in sys.argv[0], as python -m does
    sys.path.insert(0, os.getcwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def one_line(error: BaseException) -> str:
    """An error's message on one line. A listing (a line ending in ':', then its items on
    lines indented deeper, as a checkpoint that does not fit is reported) reads 'heading:
    item, item'; the other lines are joined by '; '."""
    parts: list[str] = []
    heading_indent = None  # the indentation of the listing being read
    for line in str(error).splitlines():
        text, indent = " ".join(line.split()), len(line) - len(line.lstrip())
        if not text:
            continue
        if heading_indent is not None and indent > heading_indent:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + text
            continue
        parts.append(text)
        heading_indent = indent if text.endswith(":") else None
    return "; ".join(parts)
