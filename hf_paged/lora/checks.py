"""What a PEFT adapter config asks of the base model, checked before any tensor is read.

Every ``LoraConfig`` option is either served, accepted for having no effect at inference, or
refused by name; an option this module does not know, set away from its default, is refused
too (a newer PEFT's variant must not be applied as plain LoRA). Which modules the config
reaches is PEFT's own matching (``check_target_module_exists``, its ``all-linear`` rule, its
per-model default targets) run over the base model's module names.
"""

from __future__ import annotations

import copy
import dataclasses

from peft import LoraConfig, PeftType, TaskType
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND
from transformers import PretrainedConfig

from hf_paged.lora.base_modules import EXPERTS, SERVED, BaseModule, base_modules, check_model_type

# Options with no bearing on inference (metadata, initialisation-only settings, dropout, which
# PEFT applies in training only), or read by the matching and scaling below.
_ACCEPTED = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "lora_alpha", "rank_pattern", "alpha_pattern",
    "use_rslora", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "lora_dropout", "runtime_config", "megatron_core", "qalora_group_size", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying", "init_lora_weights",
}
# Options refused when set away from their default, and what they would ask for.
_REFUSED = {
    "fan_in_fan_out": "weights stored in x out; Qwen3's projections are nn.Linear",
    "bias": "biases trained beside LoRA",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained modules beside LoRA",
    "trainable_token_indices": "trained embedding rows",
    "megatron_config": "Megatron-parallel LoRA layers",
    "use_qalora": "QALoRA",
    "layer_replication": "replicated decoder layers",
    "target_parameters": f"LoRA on parameters, which is how PEFT reaches MoE experts: {EXPERTS}",
    "use_dora": "DoRA",
}
# Initialisations that change the base weights: such an adapter is relative to the residual
# base PEFT left, not to the checkpoint (PEFT converts it on save_pretrained with
# path_initial_model_for_weight_conversion, which writes init_lora_weights=True).
_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _refuse(name: str, value, why: str) -> ValueError:
    return ValueError(f"adapter option {name}={value!r} is not served ({why}); {SERVED}")


def _check_options(config: LoraConfig) -> None:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "init_lora_weights":
            if value in field.metadata.get("lora_variants", ()):
                raise _refuse(field.name, value, "a LoRA variant")
            if isinstance(value, str) and value.lower().startswith(_MUTATING_INITS):
                raise _refuse(field.name, value, "the adapter is relative to the base weights "
                              "its initialisation changed; convert it with save_pretrained("
                              "path_initial_model_for_weight_conversion=...)")
        elif field.name in _ACCEPTED or value == _default(field) or (
                field.name == "target_parameters" and not value):
            continue
        elif field.name in _REFUSED:
            raise _refuse(field.name, value, _REFUSED[field.name])
        elif field.metadata.get("is_lora_variant"):
            raise _refuse(field.name, value, "a LoRA variant")
        else:
            raise _refuse(field.name, value, "an option this version of hf_paged does not know")


def _plain(value) -> object:
    """An enum option as adapter_config.json spells it."""
    return getattr(value, "value", value)


def _shown(target_modules) -> object:
    if isinstance(target_modules, (set, frozenset)):
        return sorted(target_modules)
    return target_modules


def _reached(config: LoraConfig, modules: list[BaseModule]) -> list[BaseModule]:
    return [m for m in modules if check_target_module_exists(config, m.name)]


def _targets(config: LoraConfig, base_config: PretrainedConfig) -> dict[tuple[int, str], str]:
    modules = base_modules(base_config)
    probe = copy.copy(config)
    target_modules = config.target_modules
    if target_modules is None:  # PEFT's default for the model type, as get_peft_model uses
        target_modules = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(
            base_config.model_type)
        if target_modules is None:
            raise ValueError(f"adapter option target_modules is not set and PEFT has no default "
                             f"for model_type {base_config.model_type!r}; {SERVED}")
        probe.target_modules = set(target_modules)
    elif (isinstance(target_modules, str)
          and target_modules.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND):
        # PEFT's rule: every linear but the output embedding, by full name; only those are
        # matched against the names (a 30B-A3B has some 25,000). The MoE router and experts
        # were linears in transformers 4 and are not in 5, so whether all-linear reached them
        # depends on what trained the adapter: its tensors tell, and one on them is refused.
        modules = [m for m in modules if m.linear and m.projection]
        probe.target_modules = {m.name for m in modules}
    entries = [target_modules] if isinstance(target_modules, str) else sorted(target_modules)
    for entry in entries:
        single = copy.copy(probe)  # the entry alone, before exclude_modules takes its share
        single.exclude_modules = None
        if not isinstance(target_modules, str):
            single.target_modules = {entry}
        if not _reached(single, modules):
            raise ValueError(f"adapter option target_modules={_shown(target_modules)!r}: "
                             f"{entry!r} matches no module of the {base_config.model_type} "
                             f"base model (layers_to_transform={config.layers_to_transform!r}); "
                             f"{SERVED}")
    targets = {}
    for module in _reached(probe, modules):
        if module.projection is None:
            raise ValueError(f"adapter option target_modules={_shown(target_modules)!r} reaches "
                             f"{module.name}: {module.refusal}; {SERVED}")
        targets[module.projection] = module.name
    if not targets:
        raise ValueError(f"adapter option exclude_modules={_shown(config.exclude_modules)!r} "
                         f"leaves no module of target_modules={_shown(target_modules)!r}; "
                         f"{SERVED}")
    return targets


def check_lora_config(config: LoraConfig, base_config: PretrainedConfig
                      ) -> dict[tuple[int, str], str]:
    """Raise a ValueError naming what ``config`` asks that is not served on ``base_config``;
    else the projections it reaches: (layer, projection) -> module name."""
    check_model_type(base_config)
    if config.peft_type != PeftType.LORA:
        raise ValueError(f"adapter option peft_type={_plain(config.peft_type)!r} is not served; "
                         f"{SERVED}")
    if config.task_type not in (None, TaskType.CAUSAL_LM):
        raise ValueError(f"adapter option task_type={_plain(config.task_type)!r} is not served "
                         f"(served: CAUSAL_LM or none); {SERVED}")
    _check_options(config)
    return _targets(config, base_config)
