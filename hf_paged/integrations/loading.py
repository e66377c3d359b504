"""transformers' ``from_pretrained`` keywords -> a ``PagedEngine``.

Hub keywords find the checkpoint as transformers finds it, placement keywords choose the
engine's device and dtype, every ``EngineConfig`` field passes through, and what is left is
applied to the model config as transformers applies it (``return_dict=False``,
``rope_theta=...``): the engine builds from that config, so an override it can honour takes
effect and one it cannot is refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.utils import find_adapter_config_file, logging

from hf_paged.config import EngineConfig
from hf_paged.engine.loading import check_has_config, resolve_checkpoint
from hf_paged.families.vision_language import causal_lm_config
from hf_paged.generation.paged_engine import PagedEngine

# transformers' own hub keywords, passed to huggingface_hub to find a checkpoint by id
# (``tqdm_class``: the download bars' class, which ``transformers serve`` always passes).
HUB_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies",
                "tqdm_class")
# Accepted and left to the engine, which chooses its own attention and loads weights lazily;
# no code runs from a checkpoint, so the revision of its code means nothing either.
_IGNORED_KEYWORDS = ("attn_implementation", "low_cpu_mem_usage", "code_revision",
                     "_from_pipeline", "_from_auto")
# transformers keywords hf_paged cannot honour: accepted at their defaults (None or False) only.
_REFUSED_UNLESS_DEFAULT = (
    "state_dict", "variant", "gguf_file", "max_memory",
    "offload_folder", "offload_buffers", "output_loading_info", "adapter_kwargs", "key_mapping",
    "tp_plan", "tp_size", "device_mesh", "distributed_config", "use_kernels", "kernel_config",
)
# Keywords taken by hf_paged: transformers' placement ones, then every EngineConfig field.
ENGINE_KEYWORDS = (
    "dtype", "torch_dtype", "device_map", "device", "subfolder", "generation_config",
    "quantization_config",
    *(f.name for f in dataclasses.fields(EngineConfig)),
)
# Config overrides the engine cannot honour, at the values it cannot: the paged kernels never
# materialise attention weights.
_REFUSED_CONFIG_VALUES = {"output_attentions": True}
# device_map strategies that accelerate spreads over GPUs; the engine takes the first one.
_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")


def adapter_and_base(path_or_id: str, kwargs: dict) -> tuple[str | None, str]:
    """As transformers' ``from_pretrained``: a folder (or hub id) holding a peft adapter
    (``adapter_config.json``) names its base checkpoint, loaded first, then the adapter.
    Returns the adapter's folder (None: not an adapter) and the checkpoint to load."""
    hub = {name: kwargs[name] for name in HUB_KEYWORDS if name in kwargs and name != "tqdm_class"}
    found = find_adapter_config_file(path_or_id, subfolder=kwargs.get("subfolder", ""), **hub)
    if found is None:
        return None, path_or_id
    with open(found) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{found}: the adapter names no base_model_name_or_path to load it on")
    return path_or_id, base


def load_engine(path_or_id: str, kwargs: dict) -> PagedEngine:
    """A ``PagedEngine`` from transformers-style ``from_pretrained`` keywords."""
    kwargs = dict(kwargs)
    engine_options = {n: kwargs.pop(n) for n in ENGINE_KEYWORDS if n in kwargs}
    hub = {name: kwargs.pop(name) for name in HUB_KEYWORDS if name in kwargs}
    for name in _IGNORED_KEYWORDS:
        kwargs.pop(name, None)
    if kwargs.pop("trust_remote_code", None):
        raise ValueError("trust_remote_code=True is refused: hf_paged runs no code from a "
                         "checkpoint (safetensors weights of known architectures only)")
    if kwargs.pop("use_safetensors", None) is False:
        raise ValueError("use_safetensors=False is refused: hf_paged loads safetensors only")
    refused = sorted(n for n in _REFUSED_UNLESS_DEFAULT if kwargs.pop(n, None) not in (None, False))
    if refused:
        raise ValueError(f"from_pretrained(): {', '.join(refused)} not supported by hf_paged")
    dtype = engine_options.pop("torch_dtype", None)
    if dtype is not None:  # transformers' own deprecation notice, as its loader gives it
        logging.get_logger("transformers.modeling_utils").warning_once(
            "`torch_dtype` is deprecated! Use `dtype` instead!")
    dtype = engine_options.pop("dtype", None) or dtype
    if "device_map" in engine_options:
        if engine_options.get("device") is not None:
            raise ValueError("pass device_map or device, not both")
        engine_options["device"] = resolve_device_map(engine_options.pop("device_map"))
    generation_config = engine_options.pop("generation_config", None)
    path = os.path.join(resolve_checkpoint(path_or_id, hub), engine_options.pop("subfolder", ""))
    hf_config = model_config(path, kwargs.pop("config", None), kwargs)
    engine = PagedEngine.from_pretrained(
        path, dtype=None if dtype == "auto" else dtype, hf_config=hf_config, **engine_options
    )
    if generation_config is not None:
        engine.generation_config = generation_config
    engine.hf_config._name_or_path = path_or_id
    return engine


def model_config(path: str, config: PretrainedConfig | str | None,
                 overrides: dict) -> PretrainedConfig:
    """The model config as transformers' ``from_pretrained`` makes it: the checkpoint's own (or
    a passed config object, copied, or a path to one) with keyword ``overrides`` applied to its
    attributes; a keyword that is no attribute of it is a ``TypeError``, as transformers' model
    constructor raises. A vision-language release's is its text config, as transformers'
    ``AutoModelForCausalLM`` takes it (``families.vision_language``)."""
    if isinstance(config, PretrainedConfig):
        config, unused = copy.deepcopy(config), dict(overrides)
    elif config is not None and not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"config must be a transformers PretrainedConfig or the path of one, "
                         f"got {type(config).__name__}")
    else:
        config = config if config is not None else path
        check_has_config(config)
        config, unused = AutoConfig.from_pretrained(config, return_unused_kwargs=True,
                                                    **overrides)
    config = causal_lm_config(config)
    if unused:
        raise TypeError(
            f"from_pretrained() got keyword(s) that are neither transformers' loading options, "
            f"hf_paged's engine options nor attributes of the model config: "
            f"{', '.join(sorted(unused))}; engine options: {', '.join(sorted(ENGINE_KEYWORDS))}"
        )
    refused = sorted(n for n, bad in _REFUSED_CONFIG_VALUES.items() if overrides.get(n) == bad
                     or getattr(config, n, None) == bad)
    if refused:
        raise ValueError(f"from_pretrained(): {', '.join(f'{n}=True' for n in refused)} is not "
                         "supported by hf_paged: the paged kernels never materialise attention "
                         "weights")
    return config


def resolve_device_map(device_map) -> torch.device | None:
    """The one device a transformers ``device_map`` names (``None``: the engine's default)."""
    if device_map is None or device_map in _DEVICE_MAP_STRATEGIES:
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(
                f"device_map spreads the model over {sorted(map(str, devices))}; hf_paged keeps "
                "a model on one device: to split it over GPUs, use tensor parallelism "
                "(tensor_parallel_size=N)"
            )
        device_map = devices.pop()
    try:
        device = torch.device("cuda", device_map) if isinstance(device_map, int) else (
            torch.device(device_map))
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device_map must name one CPU or CUDA device (None, 'auto', 'cpu', "
                         f"'cuda', 'cuda:N', N or {{'': N}}), got {device_map!r}")
    return device
