"""A step enqueued on the device, and its collection: sampled tokens reach the host through a
pinned buffer the runner reuses, with an event the collector waits for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.step import StepResult


@dataclass
class LaunchedStep:
    """A step enqueued on the device; ``tokens`` (one per sampled row) is valid once ``done``
    has passed."""

    tokens: torch.Tensor | None
    done: torch.cuda.Event | None
    # Group members' rows: (top scores, their token ids, whole score rows, whole logit rows).
    candidates: tuple | None = None
    # With ``StepPlan.report_probs``: each token's probability, beside ``tokens``.
    probs: torch.Tensor | None = None


def collect(step: LaunchedStep) -> StepResult:
    """Wait for a launched step; return its sampled tokens, group members' candidates and
    the tokens' probabilities when the plan asked for them."""
    if step.tokens is None:
        return StepResult([], [])
    if step.done is not None:
        step.done.synchronize()
    probs = [] if step.probs is None else step.probs.tolist()
    if step.candidates is None:
        return StepResult(step.tokens.tolist(), [], probs)
    top, ids, scores, logits, keys = step.candidates
    rows = [(None, None)] * len(top) if scores is None else list(zip(scores, logits))
    keys = [None] * len(top) if keys is None else list(keys)
    return StepResult(step.tokens.tolist(),
                      [(t, i, *r, key) for t, i, r, key in zip(top, ids, rows, keys)], probs)


def pinned_copy(values: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of ``values`` to the host, in ``buffer`` when it fits."""
    if len(values) > len(buffer):  # a step verifying many drafts
        return to_host(values)
    host = buffer[: len(values)]
    host.copy_(values, non_blocking=True)
    return host


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
