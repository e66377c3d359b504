"""The model call on a rank: transformers' forward over padded rows on a scratch KV cache
(``modeling.full_forward``), then the LM head over the kept positions; every rank of a
tensor-parallel group runs it on the same ``ModelCall``."""

from __future__ import annotations

import contextlib

import torch

from hf_paged.modeling.full_forward import full_forward
from hf_paged.step import ModelCall
from hf_paged.worker.runner import ModelRunner


@torch.no_grad()
def run_model_call(runner: ModelRunner, call: ModelCall, everywhere: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor | None, ...] | None:
    """The final hidden states (``call.logits_to_keep`` None; every rank holds them whole),
    else the logits of the kept positions in the model dtype: on rank 0 only (None on the
    others), or on every rank with ``everywhere``. With ``call.output_hidden_states``, a
    tuple: that, then transformers' ``hidden_states`` (every rank holds them whole). A hybrid
    model's linear-attention layers run on scratch state slots, one a row."""
    lora = None if call.lora_slots is None else (runner.lora.batch, call.lora_slots)
    states = runner.states
    with states.scratch(call.input_ids.shape[0]) if states else contextlib.nullcontext():
        streams = full_forward(runner.model, call.input_ids, call.attention_mask,
                               call.position_ids, runner.config.block_size, lora,
                               streams=call.output_hidden_states)
    hidden = streams[-1] if call.output_hidden_states else streams
    keep = call.logits_to_keep
    if keep is not None:
        if isinstance(keep, int):
            hidden = hidden[:, -keep:] if keep else hidden
        else:
            hidden = hidden[:, keep.to(hidden.device)]
        head = runner.model.lm_head
        hidden = head.gather(head(hidden), everywhere)
    return (hidden, *streams) if call.output_hidden_states else hidden
