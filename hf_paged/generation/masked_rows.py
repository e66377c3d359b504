"""Rows whose attention mask keeps no token (an empty prompt: a lone BOS that is also the pad
token, say), which transformers still generates for.

transformers' first step gives such a row's last position an attention output of zero (every
key is masked); its new tokens then attend to each other only, from position 0. So the row
is a request that starts from its first token: that token is drawn here, as transformers'
first step draws it (the forward over the padded rows, the call's own processors over the
batch, argmax or a draw from the softmax), and the engine continues from it.
"""

from __future__ import annotations

import torch

from hf_paged.generation.settings import Resolved


def first_tokens(engine, resolved: Resolved, rows: list[int], do_sample: bool
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The first new token of each of ``rows`` (all masked), with its float32 logits and
    processed scores rows."""
    device = engine.device
    ids = resolved.input_ids[rows].to(device)
    mask = resolved.attention_mask[rows].to(device)
    positions = torch.ones_like(ids)  # transformers' position of a masked token
    logits = engine.forward(ids, mask, positions, logits_to_keep=1)[:, -1].float()
    batch = resolved.input_ids.shape[0]
    full = logits.new_zeros(batch, logits.shape[-1])  # as for rows not sampling a step
    at = torch.tensor(rows, device=device)
    full[at] = logits
    scores = resolved.processors(resolved.input_ids.to(device), full)[at]
    if do_sample:
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[:, 0]
    else:
        tokens = scores.argmax(-1)
    return tokens.tolist(), logits, scores
