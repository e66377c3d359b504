"""A PEFT LoRA adapter -> LoraAdapter: read from the folder PEFT's save_pretrained writes, or
from weights already in memory, every tensor checked against the base model's shapes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch
from peft import LoraConfig, PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file
from transformers import PretrainedConfig

from hf_paged.lora.adapter import LoraAdapter, LoraWeight
from hf_paged.lora.base_modules import explain, projection_shape
from hf_paged.lora.checks import check_lora_config

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's keys: saved, base_model.model.<module>.lora_A.weight; in memory (the model's
# state_dict), with the adapter's name before .weight.
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def read_config(path: str) -> PeftConfig:
    """The adapter's config, as PEFT reads it; an option PEFT does not know (which PEFT would
    drop with a warning) is an error."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (not a PEFT adapter folder)")
    with open(file) as f:
        saved = json.load(f)
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(saved.get("peft_type"))
    if config_cls is None:
        raise ValueError(f"{file}: peft_type={saved.get('peft_type')!r} is not one PEFT knows")
    unknown = sorted(saved.keys() - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise ValueError(f"{file}: options {unknown} are unknown to the installed peft "
                         f"(saved by a newer one?)")
    return LoraConfig.from_pretrained(path)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    for weights_name in WEIGHTS_NAMES:
        file = os.path.join(path, weights_name)
        if os.path.isfile(file):
            if weights_name.endswith(".safetensors"):
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: neither {' nor '.join(WEIGHTS_NAMES)}")


def read_adapter(path: str, name: str, base_config: PretrainedConfig,
                 dtype: torch.dtype) -> LoraAdapter:
    """The adapter PEFT saved in folder ``path``, named ``name``, its tensors in ``dtype``; its
    config is checked against ``base_config`` before any tensor is read."""
    config = read_config(path)
    targets = check_lora_config(config, base_config)
    return _adapter(config, targets, _read_weights(path), name, base_config, dtype)


def adapter_from_state(config: LoraConfig, state: dict[str, torch.Tensor], name: str,
                       base_config: PretrainedConfig, dtype: torch.dtype) -> LoraAdapter:
    """The adapter of PEFT weights in memory (``get_peft_model_state_dict``'s keys, or with
    the adapter's name as the injected modules hold them) under ``config``."""
    return _adapter(config, check_lora_config(config, base_config), state, name, base_config,
                    dtype)


def _scaling(config: LoraConfig, module: str) -> tuple[int, float]:
    """The module's rank and scaling, as PEFT's LoraModel._create_and_replace and
    LoraLayer.update_layer resolve them."""
    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
    if r <= 0:
        raise ValueError(f"adapter option r / rank_pattern gives {module} rank {r}: a rank must "
                         f"be positive")
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module),
                                     config.lora_alpha)
    return r, alpha / (math.sqrt(r) if config.use_rslora else r)


def _adapter(config: LoraConfig, targets: dict[tuple[int, str], str],
             state: dict[str, torch.Tensor], name: str, base_config: PretrainedConfig,
             dtype: torch.dtype) -> LoraAdapter:
    by_module = {module: target for target, module in targets.items()}
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {t: {} for t in targets}
    for key, tensor in state.items():
        match = _KEY.fullmatch(key)
        if match is None or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"adapter tensor {key}: not a LoRA weight (lora_A / lora_B)")
        target = by_module.get(match["module"])
        if target is None:
            raise ValueError(f"adapter tensor {key}: {explain(base_config, match['module'])}")
        if match["ab"] in found[target]:
            raise ValueError(f"adapter tensor {key}: a second lora_{match['ab']} for "
                             f"{match['module']} (first: {found[target][match['ab']][0]})")
        found[target][match["ab"]] = key, tensor
    weights = {}
    for target, module in targets.items():
        for ab in "AB":
            if ab not in found[target]:
                raise ValueError(f"adapter tensor base_model.model.{module}.lora_{ab}.weight is "
                                 f"missing: the adapter's config targets {module}")
        r, scaling = _scaling(config, module)
        in_features, out_features = projection_shape(base_config, target[1])
        (a_key, a), (b_key, b) = found[target]["A"], found[target]["B"]
        for key, tensor, shape in ((a_key, a, (r, in_features)), (b_key, b, (out_features, r))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"adapter tensor {key}: shape {list(tensor.shape)}, where "
                                 f"{module} with r={r} takes {list(shape)}")
        # detached: weights taken from PEFT's modules are parameters that require grad
        weights[target] = LoraWeight(a.detach().to(dtype), b.detach().to(dtype), scaling)
    return LoraAdapter(name, weights)
