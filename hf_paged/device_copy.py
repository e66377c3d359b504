"""Tensors between host and device: host lists onto the device without waiting for it, and
whole results (transformers' output dicts) moved at once."""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied asynchronously: ``torch.tensor(...,
    device=...)`` copies synchronously, which would wait for the step before."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def moved(value: Any, device: torch.device | str) -> Any:
    """``value`` with its tensors (in tuples, lists and dicts, transformers' output dicts
    among them, changed in place) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = moved(item, device)
    return value
