"""LoRA adapters named on a command line (``--lora NAME=PATH``, as vLLM's ``--lora-modules``):
parsed, checked against the base model's config before the model loads, and loaded into an
engine. Every error names the flag and the adapter's path (``AdapterSpecError``). PEFT, which
reads adapters, is imported only when there are some."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LORA_FLAG = "--lora"


class AdapterSpecError(ValueError):
    """A ``--lora NAME=PATH`` that cannot be served; the message names the flag and path."""


def parse_lora(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> ``(name, path)``; the path must be a folder."""
    name, sep, path = text.partition("=")
    name = name.strip()
    if not sep or not name or not path:
        raise AdapterSpecError(f"{LORA_FLAG} takes NAME=PATH (a folder PEFT's save_pretrained "
                               f"wrote), got {text!r}")
    if not os.path.isdir(path):
        raise AdapterSpecError(f"{LORA_FLAG} {name}={path}: no such folder")
    return name, path


def parse_loras(texts: list[str]) -> dict[str, str]:
    """Each ``NAME=PATH`` parsed, names unique: ``{name: path}`` in the order given."""
    loras: dict[str, str] = {}
    for text in texts:
        name, path = parse_lora(text)
        if name in loras:
            raise AdapterSpecError(f"{LORA_FLAG} {name}: named twice ({loras[name]} and {path})")
        loras[name] = path
    return loras


def check_loras(loras: dict[str, str], base_config: PretrainedConfig) -> None:
    """Check each adapter's config against the base model's (no tensor is read), and that its
    weights file is there: a bad adapter is refused before the base model loads."""
    try:  # PEFT: imported when adapters are used
        from hf_paged.lora.checks import check_lora_config
        from hf_paged.lora.reading import WEIGHTS_NAMES, read_config
    except ImportError as error:
        raise AdapterSpecError(f"{LORA_FLAG} needs peft, which does not import here ({error}); "
                               f"install it: pip install 'hf_paged[lora]'") from error

    for name, path in loras.items():
        try:
            check_lora_config(read_config(path), base_config)
            if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHTS_NAMES):
                raise FileNotFoundError(f"{path}: neither {' nor '.join(WEIGHTS_NAMES)}")
        except (ValueError, OSError) as error:
            raise AdapterSpecError(f"{LORA_FLAG} {name}={path}: {error}") from error


def load_loras(engine, loras: dict[str, str]) -> None:
    """Read each adapter (in the engine's dtype) and load it into ``engine`` under its name."""
    from hf_paged.lora.reading import read_adapter

    for name, path in loras.items():
        try:
            engine.add_lora(name, read_adapter(path, name, engine.hf_config, engine.dtype))
        except (ValueError, OSError) as error:
            raise AdapterSpecError(f"{LORA_FLAG} {name}={path}: {error}") from error
