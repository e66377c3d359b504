"""Engine results in transformers' shapes: the padded ``sequences`` tensor and, with
``return_dict_in_generate``, ``GenerateDecoderOnlyOutput``."""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


def pad_outputs(input_ids: torch.Tensor, outputs: list[list[int]], pad: int) -> torch.Tensor:
    """The prompt rows followed by each row's new tokens, short rows filled with ``pad``."""
    longest = max(len(o) for o in outputs)
    new = torch.full((len(outputs), longest), pad, dtype=input_ids.dtype)
    for i, o in enumerate(outputs):
        new[i, : len(o)] = torch.tensor(o, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def per_step(
    rows: list[list[torch.Tensor]], steps: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``rows[r][t]`` (one vector per row and step) as transformers' tuple over steps of
    ``[batch, vocab]`` tensors on ``device``."""
    return tuple(torch.stack([row[t] for row in rows]).to(device) for t in range(steps))


def decoder_only_output(sequences, scores=None, logits=None) -> GenerateDecoderOnlyOutput:
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
