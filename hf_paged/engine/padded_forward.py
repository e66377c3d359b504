"""The model call beside the step loop: transformers' forward over padded rows, for the
drop-in model's ``__call__`` and ``generate``'s masked rows, on a scratch KV cache."""

from __future__ import annotations

import torch

from hf_paged.step import ModelCall


class PaddedForward:
    """``EngineCore``'s forward over padded batches (it provides ``closed``, ``config``,
    ``executor`` and ``adapters``)."""

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, adapters: list[str | None] | None = None,
                      output_hidden_states: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """transformers' model forward over padded ``[batch, seq_len]`` rows (SDPA attention):
        the final (normed) hidden states, on a scratch KV cache, so the engine's cache and
        prefix cache are left alone; ``adapters``: each row's LoRA adapter (None: the base
        model). Under tensor parallelism every rank runs it. ``output_hidden_states``: a
        tuple, those and then transformers' ``hidden_states`` (every layer's input and the
        final ones)."""
        return self._call(ModelCall(input_ids, attention_mask, position_ids,
                                    output_hidden_states=output_hidden_states), adapters)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0,
                adapters: list[str | None] | None = None, output_hidden_states: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The logits of ``hidden_states`` (``logits_to_keep`` as transformers takes it), in
        the model dtype (with ``output_hidden_states``: first in a tuple, as there)."""
        return self._call(ModelCall(input_ids, attention_mask, position_ids,
                                    logits_to_keep=logits_to_keep,
                                    output_hidden_states=output_hidden_states), adapters)

    def _call(self, call: ModelCall, adapters: list[str | None] | None
              ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.closed:
            raise RuntimeError("this model was closed; load it again to use it")
        if adapters is not None:
            if len(adapters) != call.input_ids.shape[0]:
                raise ValueError(f"adapter names: one per row, got {len(adapters)} for "
                                 f"{call.input_ids.shape[0]} rows")
            call.lora_slots = [self.adapters.resolve(name)[0] for name in adapters]
        return self.executor.model_call(call)
