"""Loading: what a checkpoint, a dtype and a device named by the user resolve to, checked
before anything is built, then the executor over the built ranks."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from hf_paged.config import EngineConfig
from hf_paged.families.vision_language import causal_lm_config
from hf_paged.step import WorkerSpec
from hf_paged.worker.executor import Executor, check_spec, create_executor


def resolve_checkpoint(path_or_id: str, hub: dict | None = None) -> str:
    """A local folder as is; anything else is a hub id that huggingface_hub downloads, with
    transformers' hub keywords ``hub`` (revision, token, cache_dir, ...)."""
    if os.path.isdir(path_or_id):
        return path_or_id
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt"],
                                 **(hub or {}))
    except Exception as error:  # huggingface_hub raises many kinds; their text is a wall
        raise OSError(
            f"{path_or_id!r} is neither a local folder nor reachable on the hub "
            f"({_short_reason(error)})"
        ) from error


def check_has_config(path: str) -> None:
    """Raise OSError naming a checkpoint folder without a config.json (transformers'
    ``AutoConfig`` says the config lacks a ``model_type`` key)."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise OSError(f"{os.path.normpath(path)!r} is a folder without a config.json, not a "
                      "checkpoint")


def _short_reason(error: BaseException) -> str:
    """The exception's class and its cause's: 'LocalEntryNotFoundError: ConnectError' says
    what went wrong (offline, no such repository, not a valid id) in a few words."""
    cause = error.__cause__ or error.__context__
    names = [type(error).__name__]
    if cause is not None and type(cause).__name__ != names[0]:
        names.append(type(cause).__name__)
    return ": ".join(names)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: PretrainedConfig) -> torch.dtype:
    """``dtype`` as a torch.dtype: a torch.dtype or its name (``"bfloat16"``,
    ``"torch.bfloat16"``); ``None`` or ``"auto"``: the checkpoint's (float32 if it names none)."""
    if dtype is None or dtype == "auto":
        own = getattr(hf_config, "dtype", None) or torch.float32
        resolved = _as_dtype(own)
        if resolved is None:
            raise ValueError(
                f"dtype: the checkpoint's dtype {own!r} is not one the engine runs; pass "
                f"dtype= one of {', '.join(_DTYPES)}"
            )
        return resolved
    resolved = _as_dtype(dtype)
    if resolved is None:
        raise ValueError(
            f"dtype must be one of {', '.join(_DTYPES)} (a torch.dtype or its name) or 'auto' "
            f"(the checkpoint's), got {dtype!r}"
        )
    return resolved


def _as_dtype(dtype: object) -> torch.dtype | None:
    if isinstance(dtype, str):  # torch's own names, its aliases ("half", "float") included
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values() else None


def resolve_device(device: torch.device | str | None) -> torch.device:
    """CUDA when available; under a launcher the GPU of the local rank."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) % torch.cuda.device_count() if local else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


def load(path_or_id: str, dtype: torch.dtype | str | None, device: torch.device | str | None,
         hf_config: PretrainedConfig | None, engine_options: dict,
         quantization_config: object = None,
         ) -> tuple[Executor, EngineConfig, GenerationConfig, int]:
    """An engine's parts: its executor (the model built on every rank), its options, the
    checkpoint's generation config and the longest sequence (see ``from_pretrained``);
    ``quantization_config`` quantizes an unquantized checkpoint as it loads."""
    config = EngineConfig.from_options(**engine_options)
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1: one engine is one replica; "
                         "hf_paged.from_pretrained and AutoModelForCausalLM.from_pretrained "
                         "start the replicas")
    path = resolve_checkpoint(path_or_id)
    if hf_config is None:
        check_has_config(path)
        hf_config = causal_lm_config(AutoConfig.from_pretrained(path))
    device = resolve_device(device)
    spec = WorkerSpec(hf_config, path, None, device, config, config.max_model_len)
    # the model, its quantization and tensor_parallel_size first: they decide the rest
    check_spec(spec, quantization_config)
    max_positions = hf_config.max_position_embeddings
    spec.max_model_len = max_model_len = config.max_model_len or max_positions
    spec.dtype = resolve_dtype(dtype, hf_config)
    if max_model_len > max_positions:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the checkpoint's "
            f"max_position_embeddings ({max_positions})"
        )
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = GenerationConfig.from_model_config(hf_config)
    return create_executor(spec), config, generation_config, max_model_len
