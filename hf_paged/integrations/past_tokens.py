"""``past_key_values`` of the model call: the tokens so far, not their keys and values.

transformers' forward returns a KV cache (``use_cache``, on by default) that the next call
continues from: a hand-written decoding loop passes it back with only the new tokens. The
model call here runs on a scratch cache it drops, so its ``past_key_values`` is a
``PastTokens``: the ids, mask and positions of every token so far. A call given one runs over
the past tokens and the new ones together and returns what transformers returns for the new
ones: the same logits, recomputed (a loop of single tokens costs a whole forward a step;
``generate`` is the fast path); like transformers' cache, the past passed in is extended in
place and returned. A cache of another kind (made by transformers, say) is
refused by name: its keys and values were computed by another model.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache


class PastTokens(Cache):
    """The rows' tokens so far ``[batch, length]``: ids, attention mask and positions."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor):
        super().__init__(layers=[])
        self.extend(input_ids, attention_mask, position_ids)

    def extend(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor) -> None:
        """Hold the rows of a call that ran over this past and new tokens (its whole rows)."""
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.position_ids = position_ids.expand(input_ids.shape)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.input_ids.shape[1]

    def crop(self, length: int) -> None:
        """The installed transformers' ``crop``: a negative ``length`` drops that many tokens
        from the end; a positive one keeps that many (versions whose argument is
        ``tokens_to_remove`` refuse it, as here)."""
        if length > 0 and "tokens_to_remove" in inspect.signature(Cache.crop).parameters:
            raise ValueError(f"Calling `crop` with a positive value (`{length}`) is not "
                             "supported: pass a negative number of tokens to remove")
        keep = self.get_seq_length() + length if length < 0 else length
        self._rows(slice(None), slice(0, max(keep, 0)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx.cpu(), slice(None))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(indices.cpu(), slice(None))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(torch.arange(self.input_ids.shape[0]).repeat_interleave(repeats),
                   slice(None))

    def reset(self) -> None:
        self.crop(0)

    def update(self, *args, **kwargs):
        raise NotImplementedError("hf_paged's past_key_values holds the tokens so far, not "
                                  "keys and values: pass it back to the model call")

    def _rows(self, rows, columns) -> None:
        for name in ("input_ids", "attention_mask", "position_ids"):
            tensor = getattr(self, name)
            rows_here = rows.to(tensor.device) if isinstance(rows, torch.Tensor) else rows
            setattr(self, name, tensor[rows_here][:, columns])


def past_argument(past_key_values, kwargs: dict):
    """The past a call passes: ``past_key_values``, or under the name newer transformers
    versions give it, ``cache`` (or ``cache_params``), taken out of ``kwargs``."""
    given = {name: kwargs.pop(name) for name in ("cache", "cache_params")
             if kwargs.get(name) is not None}
    if past_key_values is not None:
        given["past_key_values"] = past_key_values
    if len(given) > 1:
        raise ValueError(f"{' and '.join(sorted(given))}: pass the past once")
    return next(iter(given.values()), None)


def with_past(past, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """The whole rows a call over ``past`` (None: none) and new ``input_ids`` runs on, as
    transformers reads them: the mask covers past and new tokens (None: all kept), the new
    tokens' positions default to their index after the past ones. Returns ids, mask,
    positions and the number of past tokens. ValueError names the argument that does not
    fit."""
    if past is None:
        return input_ids, attention_mask, position_ids, 0
    if not isinstance(past, PastTokens):
        raise ValueError(f"past_key_values: a {type(past).__name__} is not served; pass None "
                         "first, then the past_key_values this model returned")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.shape[0] != past.input_ids.shape[0]:
        raise ValueError(f"input_ids: past_key_values holds {past.input_ids.shape[0]} rows; "
                         "the new tokens must be a [rows, new_tokens] tensor of as many")
    length, new = past.get_seq_length(), input_ids.shape[1]
    device = past.input_ids.device
    ids = torch.cat([past.input_ids, input_ids.to(device)], 1)
    if attention_mask is None:
        mask = torch.cat([past.attention_mask, torch.ones_like(input_ids, device=device)], 1)
    elif attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask: with past_key_values it covers the past and the new "
                         f"tokens, shape {tuple(ids.shape)}; got {tuple(attention_mask.shape)}")
    else:
        mask = attention_mask.to(device)
    if position_ids is None:
        position_ids = torch.arange(length, length + new, device=device)[None]
    if position_ids.dim() > 2 or position_ids.shape[-1] != new:
        raise ValueError(f"position_ids must have shape [batch, {new}] (the new tokens), got "
                         f"{tuple(position_ids.shape)}")
    positions = torch.cat([past.position_ids, position_ids.to(device).expand(input_ids.shape)],
                          1)
    return ids, mask, positions, length


def kept_of_new(logits_to_keep: int | torch.Tensor, past_length: int, new: int
                ) -> int | torch.Tensor:
    """``logits_to_keep`` over the new tokens as the same choice over the whole rows."""
    if isinstance(logits_to_keep, int):
        return new if logits_to_keep == 0 else min(logits_to_keep, new)
    return logits_to_keep + past_length
