"""What a checkpoint, a dtype and an attention backend named by the user resolve to."""

from __future__ import annotations

import importlib
import os

import torch
from transformers import PretrainedConfig

from hf_paged.kernels.flash_attn import PAGE_MULTIPLE


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


def resolve_backend(backend: str | None, device: torch.device, block_size: int) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" and _importable("triton") else "sdpa"
    if backend == "triton" and (device.type != "cuda" or not _importable("triton")):
        raise ValueError("attention_backend 'triton' needs a CUDA device and the triton package")
    if backend == "flash_attn":
        if device.type != "cuda" or not _importable("flash_attn"):
            raise ValueError(
                "attention_backend 'flash_attn' needs a CUDA device and the flash-attn package"
            )
        if block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"attention_backend 'flash_attn' needs block_size {PAGE_MULTIPLE} (flash-attn's "
                f"paged cache takes pages of a multiple of {PAGE_MULTIPLE}), got {block_size}"
            )
    return backend


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True
