"""``hf-paged serve``: transformers' own ``transformers serve``, with Qwen3 checkpoints on hf_paged.

Nothing of the server is hf_paged's: the installed transformers' ``transformers`` console command
runs in this process, unchanged (its typer CLI, FastAPI app, handlers and uvicorn), after
``patch_transformers()``. Its model manager loads a checkpoint through
``transformers.<Architecture>.from_pretrained``, which the patch serves with hf_paged for Qwen3
checkpoints, so ``/v1/chat/completions``, ``/v1/completions`` and the rest call hf_paged's
``generate`` (or, with ``--continuous-batching``, its ``init_continuous_batching``).

Added around transformers' app (``serve_front``): a request the engine refuses (a prompt too
long for ``max_model_len`` or the KV cache, a bad sampling value) gets a 400 in OpenAI's error
shape, naming the problem, before its response starts, where transformers would answer a bare
500 or an error event inside a 200 stream (``serve_errors``); an API key, limits on a request's
body and ``max_tokens``, ``/health`` naming a broken engine, and ``/metrics``.

transformers serve's flags set only transformers' loading keywords (``--dtype``, ``--device``,
...), so engine options travel another way: hf-paged takes ``--engine-option KEY=VALUE`` out of
the arguments before handing the rest over, and the patch applies them as defaults to every
hf_paged load. hf-paged's server flags (``--api-key``, ``--max-body-bytes``, ``--max-tokens``,
``--switch-interval-ms``, ``--engine-process``, ``--data-parallel-size``, ``--lora``) are taken
out the same way.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable

ENGINE_OPTION = "--engine-option"
SERVE_HELP = f"""\
hf-paged serve: `transformers serve` with Qwen3 checkpoints loaded on hf_paged's engine.
hf-paged's own options (anywhere among the arguments; --engine-option repeatable):
  {ENGINE_OPTION} KEY=VALUE   an engine option for every model the server loads, e.g.
                             {ENGINE_OPTION} max_model_len=4096 {ENGINE_OPTION} num_kv_blocks=2048
                             (VALUE is a Python literal: 128, 0.9, True, None; else a string)
  --api-key KEY              every endpoint but /health needs 'Authorization: Bearer KEY'
                             (default: the HF_PAGED_API_KEY environment variable; none: open)
  --max-body-bytes N         refuse request bodies over N bytes with a 413 (default 4 MiB)
  --max-tokens N             refuse requests asking for over N new tokens with a 400
                             (default: the engine's max_model_len bounds a request)
  --switch-interval-ms MS    the interpreter's thread switch interval (default: Python's 5):
                             how long the engine's loop may wait for the GIL after a step
  --engine-process           the engine in a process of its own (with --continuous-batching):
                             the server's per-token work shares no GIL with its steps
  --data-parallel-size N     N engine processes (with --continuous-batching), replica i on
                             GPUs [i*tp, (i+1)*tp); each request to the least-loaded one
  --lora NAME=PATH           a LoRA adapter (a folder PEFT saved) served beside MODEL, chosen
                             by a request's model field NAME (repeatable; MODEL named on the
                             command line)
/health answers 503 naming why when an engine is broken; /metrics is Prometheus' text format.
Every other argument is transformers serve's own:
"""


# What ``transformers serve`` needs beyond transformers itself: the modules its own check
# (``is_serve_available``) looks for, installed by transformers' ``serving`` extra.
SERVE_MODULES = ("pydantic", "fastapi", "uvicorn", "openai")


def check_serve_extras() -> None:
    """Raise ImportError naming what to install when transformers serve's extras are missing,
    before transformers' command is imported (its own error ends a long traceback)."""
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"transformers serve needs its serving extras, and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed: "
                          'pip install "transformers[serving]"')


def parse_engine_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> ``(key, value)``; the value is a Python literal (``128``, ``0.5``,
    ``True``, ``None``) or else the text itself (``sdpa``)."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"{ENGINE_OPTION} takes KEY=VALUE (e.g. max_model_len=4096), got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key, value


def take_engine_options(argv: list[str], anywhere: bool) -> tuple[dict[str, object], list[str]]:
    """Split ``--engine-option KEY=VALUE`` (or ``--engine-option=KEY=VALUE``) out of ``argv``:
    everywhere when ``anywhere``, else only where they lead (what follows a script or command
    is its own)."""
    options: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == ENGINE_OPTION or arg.startswith(ENGINE_OPTION + "="):
            if arg == ENGINE_OPTION:
                if i + 1 == len(argv):
                    raise ValueError(f"{ENGINE_OPTION} needs KEY=VALUE after it")
                arg, i = argv[i + 1], i + 1
            else:
                arg = arg[len(ENGINE_OPTION) + 1:]
            key, value = parse_engine_option(arg)
            options[key] = value
        elif anywhere:
            rest.append(arg)
        else:
            return options, rest + argv[i:]
        i += 1
    return options, rest


def console_command(name: str):
    """The installed console command ``name``'s entry point (what its executable calls), or
    None."""
    for entry_point in importlib.metadata.entry_points(group="console_scripts", name=name):
        return entry_point
    return None


def run_console_command(name: str, args: list[str], prog: str | None = None) -> int:
    """Run the console command ``name`` in this process as its executable would: ``sys.argv``
    is ``[prog or name, *args]`` and its entry point's return value is the exit status (a
    ``SystemExit`` it raises propagates, as from the executable)."""
    entry_point = console_command(name)
    if entry_point is None:
        raise LookupError(f"no console command {name!r} is installed")
    main = entry_point.load()
    sys.argv = [prog or name, *args]
    status = main()
    return 0 if status is None else status


def serve_command(args: list[str]) -> Callable[[], int]:
    """What runs ``hf-paged serve ARGS`` (engine options taken out already): hf-paged's server
    flags are parsed now (a bad one raises ValueError naming it), the rest go to
    ``transformers serve``."""
    from hf_paged.integrations.serve_options import take_front_options

    options, rest = take_front_options(args)
    return lambda: transformers_serve(rest, options)


def transformers_serve(args: list[str], options=None) -> int:
    """``transformers serve ARGS``, as its console command runs it (under the name hf-paged, so
    that its usage lines read ``hf-paged serve``), its app extended by ``serve_front`` with
    ``options`` (a ``FrontOptions``; None: the defaults). Patch transformers first."""
    from hf_paged.integrations import serve_front
    from hf_paged.integrations.serve_options import FrontOptions

    uninstall = serve_front.install(options or FrontOptions())
    try:
        return run_console_command("transformers", ["serve", *args], prog="hf-paged")
    finally:
        uninstall()
