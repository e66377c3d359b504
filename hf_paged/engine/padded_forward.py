"""The model call beside the step loop: transformers' forward over padded rows, for the
drop-in model's ``__call__`` and ``generate``'s masked rows, on a scratch KV cache."""

from __future__ import annotations

import torch


class PaddedForward:
    """``EngineCore``'s forward over padded batches (it provides ``closed``, ``config``,
    ``executor`` and ``adapters``)."""

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, adapters: list[str | None] | None = None
                      ) -> torch.Tensor:
        """transformers' model forward over padded ``[batch, seq_len]`` rows (SDPA attention):
        the final (normed) hidden states, on a scratch KV cache, so the engine's cache and
        prefix cache are left alone; ``adapters``: each row's LoRA adapter (None: the base
        model)."""
        if self.closed:
            raise RuntimeError("this model was closed; load it again to use it")
        if self.config.tensor_parallel_size > 1:  # the other ranks only follow steps
            raise ValueError("the model call (forward) runs in one process: it is not available "
                             "with tensor_parallel_size > 1; generate() is")
        slots = None
        if adapters is not None:
            if len(adapters) != input_ids.shape[0]:
                raise ValueError(f"adapter names: one per row, got {len(adapters)} for "
                                 f"{input_ids.shape[0]} rows")
            slots = [self.adapters.resolve(name)[0] for name in adapters]
        return self.executor.hidden_states(input_ids, attention_mask, position_ids, slots)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0,
                adapters: list[str | None] | None = None) -> torch.Tensor:
        """The logits of ``hidden_states`` (``logits_to_keep`` as transformers takes it), in
        the model dtype."""
        hidden = self.hidden_states(input_ids, attention_mask, position_ids, adapters)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep.to(hidden.device)]
        return self.executor.logits(hidden)
