"""``hf-paged serve``'s own server options (``--api-key``, ``--max-body-bytes``,
``--max-tokens``, ``--switch-interval-ms``, ``--engine-process``, ``--data-parallel-size``,
``--lora``): taken out of
the command line before transformers' ``serve`` parses the rest (``serve_front`` applies them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hf_paged.lora.named import LORA_FLAG, parse_loras

API_KEY_ENV = "HF_PAGED_API_KEY"


@dataclass(frozen=True)
class FrontOptions:
    """hf-paged serve's own server options (``--api-key``, ``--max-body-bytes``,
    ``--max-tokens``, ``--switch-interval-ms``, ``--engine-process``, ``--data-parallel-size``,
    ``--lora``)."""

    api_key: str | None = None
    max_body_bytes: int = 4 << 20  # a prompt of max_model_len tokens fits many times over
    max_tokens: int | None = None  # None: the engine's max_model_len bounds a request
    # The interpreter's thread switch interval: how long the engine's loop, woken from a wait
    # on the device, may wait for the GIL while the event loop runs Python (None: Python's
    # 5 ms; benchmarks/gil_handoff.py measures what it costs).
    switch_interval_ms: float | None = None
    # The engine and its loop in a process of their own (``engine_process``): the server's
    # per-token work no longer shares a GIL with the engine's steps.
    engine_process: bool = False
    # Engine processes (``--engine-process``'s) that share the requests, each to the one with
    # the fewest outstanding; replica i on GPUs [i * tp, (i + 1) * tp) (``data_parallel``).
    data_parallel_size: int = 1
    # LoRA adapters served by name beside the model (``--lora NAME=PATH``): (name, folder).
    loras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        for name, value in (("--max-body-bytes", self.max_body_bytes),
                            ("--max-tokens", self.max_tokens),
                            ("--data-parallel-size", self.data_parallel_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        interval = self.switch_interval_ms
        if interval is not None and not 0 < interval <= 1000:
            raise ValueError(f"--switch-interval-ms must be in (0, 1000], got {interval!r}")


SWITCHES = {"--engine-process": "engine_process"}  # flags without a value
FLAGS = {"--api-key": "api_key", "--max-body-bytes": "max_body_bytes",
         "--max-tokens": "max_tokens", "--switch-interval-ms": "switch_interval_ms",
         "--data-parallel-size": "data_parallel_size",
         LORA_FLAG: "loras"}  # repeatable


def take_front_options(argv: list[str]) -> tuple[FrontOptions, list[str]]:
    """Split hf-paged serve's own flags (``--api-key KEY``, ``--max-body-bytes N``,
    ``--max-tokens N``, ``--switch-interval-ms MS``, ``--data-parallel-size N``,
    ``--lora NAME=PATH``, also as
    ``--flag=value``) out of ``argv``; the API key defaults to the ``HF_PAGED_API_KEY``
    environment variable."""
    values: dict[str, Any] = {}
    loras: list[str] = []
    env_key = os.environ.get(API_KEY_ENV)
    if env_key:
        values["api_key"] = env_key
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag, sep, value = argv[i].partition("=")
        if argv[i] in SWITCHES:
            values[SWITCHES[argv[i]]] = True
            i += 1
            continue
        if flag not in FLAGS:
            rest.append(argv[i])
            i += 1
            continue
        if not sep:
            if i + 1 == len(argv):
                raise ValueError(f"{flag} needs a value after it")
            value, i = argv[i + 1], i + 1
        field = FLAGS[flag]
        if field == "loras":
            loras.append(value)
            i += 1
            continue
        if field == "switch_interval_ms":
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{flag} must be a number, got {value!r}") from None
        elif field != "api_key":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}") from None
        values[field] = value
        i += 1
    for flag, on in (("--engine-process", values.get("engine_process", False)),
                     ("--data-parallel-size", values.get("data_parallel_size", 1) != 1)):
        if on and "--continuous-batching" not in rest:
            raise ValueError(f"{flag} serves with --continuous-batching only: add it")
    if loras:
        values["loras"] = tuple(parse_loras(loras).items())
    return FrontOptions(**values), rest
