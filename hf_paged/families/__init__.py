"""Model families: which checkpoints hf_paged serves, and the module that knows each one.

A checkpoint's ``config.model_type`` picks its family module (``families/qwen3.py``, ...; what a
family module provides is listed in that one's docstring). The registry names modules rather
than holding them: asking whether a model_type is served imports none, and a family's module
is imported when something first asks for it (a checkpoint of it checked or built, its drop-in
class named). ``build_model`` (``families/build.py``) builds any family's model.

A new family is one module plus its kernels, and one line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from transformers import PretrainedConfig

from hf_paged.quantization import Fp8Scheme

# config.model_type -> the module of the family that serves it.
REGISTRY: dict[str, str] = {
    "qwen3": "hf_paged.families.qwen3",
    "qwen3_moe": "hf_paged.families.qwen3_moe",
    "qwen3_next": "hf_paged.families.qwen3_next",
    "qwen3_5_text": "hf_paged.families.qwen3_5",
    "qwen3_5_moe_text": "hf_paged.families.qwen3_5_moe",
}


def supported_model_types() -> tuple[str, ...]:
    """The ``config.model_type`` values hf_paged serves."""
    return tuple(REGISTRY)


def all_families() -> list[ModuleType]:
    """Every registered family's module, once each, in registration order (imports them)."""
    names = dict.fromkeys(REGISTRY.values())
    return [importlib.import_module(name) for name in names]


def supported_description() -> str:
    """What hf_paged serves, as errors say it: "Qwen3 checkpoints (model_type 'qwen3',
    Qwen3ForCausalLM)", joined with "and" when there are several families."""
    return " and ".join(
        f"{family.NAME} checkpoints (model_type "
        f"{', '.join(repr(t) for t in family.MODEL_TYPES)}, {family.ARCHITECTURE})"
        for family in all_families()
    )


def family_for(config_or_model_type: PretrainedConfig | str) -> ModuleType:
    """The family module that serves a config (or a model_type). Raises ValueError naming what
    hf_paged supports and the checkpoint's model_type when no family does."""
    model_type = (config_or_model_type if isinstance(config_or_model_type, str)
                  else getattr(config_or_model_type, "model_type", None))
    if model_type not in REGISTRY:
        raise ValueError(f"hf_paged supports {supported_description()}; this checkpoint has "
                         f"model_type {model_type!r}")
    return importlib.import_module(REGISTRY[model_type])


def check_model(config: PretrainedConfig, tp_size: int,
                quantization: Fp8Scheme | None = None, expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the problem, unless hf_paged can run ``config``'s model split
    over ``tp_size`` tensor-parallel ranks: its family's checks, then the split's (which must
    not cut the blocks of ``quantization``'s FP8 weights; ``expert_parallel``: routed experts
    split whole, ``EngineConfig.moe_parallel``)."""
    family = family_for(config)
    family.check_config(config)
    block = quantization.block if quantization and not quantization.dequantize else None
    family.check_shardable(config, tp_size, block, expert_parallel)


__all__ = ["REGISTRY", "all_families", "check_model", "family_for", "supported_description",
           "supported_model_types"]
