"""hf_paged: paged-KV, continuous-batching generation for Hugging Face Qwen3 checkpoints."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names and their modules, imported on first use: the command line and
# ``python -m hf_paged`` start without torch and transformers (seconds of imports) until a
# command needs them.
_EXPORTS = {
    "AutoModelForCausalLM": "hf_paged.integrations.causal_lm",
    "EngineConfig": "hf_paged.config",
    "PagedEngine": "hf_paged.generation.paged_engine",
    "Qwen3ForCausalLM": "hf_paged.integrations.causal_lm",
    "SamplingParams": "hf_paged.sampling_params",
    "from_pretrained": "hf_paged.integrations.data_parallel",
    "Speculation": "hf_paged.sampling_params",
    "patch_transformers": "hf_paged.integrations.patch",
    "unpatch_transformers": "hf_paged.integrations.patch",
}

__all__ = [
    "AutoModelForCausalLM", "EngineConfig", "PagedEngine", "Qwen3ForCausalLM", "SamplingParams",
    "Speculation", "from_pretrained", "patch_transformers", "unpatch_transformers",
]

if TYPE_CHECKING:
    from hf_paged.config import EngineConfig
    from hf_paged.generation.paged_engine import PagedEngine
    from hf_paged.integrations.causal_lm import AutoModelForCausalLM, Qwen3ForCausalLM
    from hf_paged.integrations.data_parallel import from_pretrained
    from hf_paged.integrations.patch import patch_transformers, unpatch_transformers
    from hf_paged.sampling_params import SamplingParams, Speculation


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
