"""What the model call shares with transformers' inner model: the checks of a forward's
inputs, and each family's inner model class (``model.model``: ``Qwen3Model``, ...), whose
forward the engine serves."""

from __future__ import annotations

from types import ModuleType

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_paged.families.vision_language import refuse_vision_inputs
from hf_paged.integrations import peft_sync
from hf_paged.integrations.family_classes import class_by_name, family_class
from hf_paged.integrations.past_tokens import PastTokens, past_argument, with_past


class PagedInnerModel:
    """transformers' inner model (``model.model``) whose forward the engine serves: the last
    hidden state, as transformers' own computes it, on a scratch cache."""

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> BaseModelOutputWithPast | tuple:
        past_key_values = past_argument(past_key_values, kwargs)
        streams = wants_hidden_states(kwargs, self.config)
        refuse_forward_options(inputs_embeds, kwargs, ())
        engine = self.engine_ref()
        if engine is None:
            raise RuntimeError("the hf_paged model this module belongs to was freed")
        *whole, past_length = with_past(past_key_values, input_ids, attention_mask, position_ids)
        inputs = forward_inputs(*whole, self.config.vocab_size)
        # (a data-parallel front holds no adapters)
        adapters = (None if engine.config.data_parallel_size > 1 else
                    row_adapters(peft_sync.sync(self, engine), input_ids.shape[0]))
        hidden = engine.hidden_states(*inputs, adapters, streams)
        hidden, *streams = hidden if streams else (hidden,)
        hidden = hidden[:, past_length:].to(input_ids.device)
        streams = tuple(s[:, past_length:].to(input_ids.device) for s in streams)
        past = past_tokens(inputs, past_key_values, use_cache, self.config)
        output = BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past,
                                         hidden_states=streams or None)
        if return_dict is None:
            return_dict = self.config.return_dict
        return output if return_dict else output.to_tuple()


def inner_model_class(family: ModuleType) -> type[PagedInnerModel]:
    """The family's inner model class, served by the engine (``hf_paged.families``)."""
    return family_class(PagedInnerModel, family.INNER_MODEL, __name__)


def __getattr__(name: str) -> type:
    return class_by_name(PagedInnerModel, name, __name__, "INNER_MODEL")


def past_tokens(inputs: tuple, past: PastTokens | None, use_cache: bool | None, config
                ) -> PastTokens | None:
    """The call's ``past_key_values``: the past it was given, extended in place by the call's
    tokens (as transformers' cache is), else a new one if ``use_cache`` (or the config's)."""
    if past is not None:
        past.extend(*inputs)
        return past
    return PastTokens(*inputs) if (config.use_cache if use_cache is None else use_cache) else None


def row_adapters(adapters: list[str | None] | None, rows: int) -> list[str | None] | None:
    """peft's adapter for each of a forward's ``rows`` rows (one name: every row's)."""
    if adapters is None:
        return None
    if len(adapters) == 1:
        return adapters * rows
    if len(adapters) != rows:
        raise ValueError(f"adapter_names: {len(adapters)} names for {rows} input rows")
    return adapters


def forward_inputs(input_ids, attention_mask, position_ids, vocab_size: int) -> tuple:
    """The checked ``input_ids``, mask and positions of a forward call (transformers'
    defaults: every token kept, positions counted from 0)."""
    input_ids = _check_input_ids(input_ids, vocab_size)
    attention_mask = _attention_mask(attention_mask, input_ids)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    if position_ids.shape[-1] != input_ids.shape[1] or position_ids.dim() > 2:
        raise ValueError(f"position_ids must have shape [batch, {input_ids.shape[1]}], "
                         f"got {tuple(position_ids.shape)}")
    return input_ids, attention_mask, position_ids


def _check_input_ids(input_ids, vocab_size: int) -> torch.Tensor:
    """Raise ValueError naming ``input_ids`` unless it is a 2-D tensor of in-vocabulary ids."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise ValueError(f"input_ids must be a 2-D tensor [batch, seq_len], got "
                         f"{type(input_ids).__name__} of shape {shape}")
    if input_ids.shape[1] == 0:  # as a tokenizer gives for "" when it adds no BOS
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a forward "
                         "needs at least one token")
    if input_ids.dtype not in (torch.int16, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold token ids as int16, int32 or int64, got "
                         f"{input_ids.dtype} (8-bit types cannot hold a vocabulary's ids)")
    if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab_size})")
    return input_ids


def _attention_mask(mask, input_ids: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {shape}")
    return mask


def wants_hidden_states(kwargs: dict, config) -> bool:
    """Whether a forward returns transformers' ``hidden_states`` (its keyword, popped from
    ``kwargs``, else the config's ``output_hidden_states``)."""
    wanted = kwargs.pop("output_hidden_states", None)
    return bool(config.output_hidden_states if wanted is None else wanted)


def refuse_forward_options(inputs_embeds, kwargs, allowed: tuple[str, ...]) -> None:
    if inputs_embeds is not None:
        raise ValueError("inputs_embeds is not supported by hf_paged's forward; pass input_ids")
    refuse_vision_inputs([n for n, v in kwargs.items() if v is not None], "forward()")
    refused = sorted(n for n, v in kwargs.items()
                     if n not in allowed and v is not None and v is not False)
    if refused:
        raise ValueError(f"forward() got argument(s) hf_paged does not support: "
                         f"{', '.join(refused)}")
