"""Host lists onto the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied asynchronously: ``torch.tensor(...,
    device=...)`` copies synchronously, which would wait for the step before."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
