"""Generation settings resolved by transformers' own code.

``GenerationMixin.generate`` prepares a call in steps that are methods of the model: merge
the checkpoint's generation_config.json, a passed ``GenerationConfig`` and keyword arguments
over the global defaults; resolve special tokens; infer the attention mask; fix ``max_length``
and ``min_length`` against the prompt width; build the logits processors and stopping
criteria. ``resolve`` runs those same methods on a stand-in model (the Qwen3 config and the
engine's generation config), so every convention, default and warning is the installed
transformers' own, and moves with it on upgrade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PretrainedConfig
from transformers.generation import GenerationMixin, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from hf_paged.families.vision_language import refuse_vision_inputs

# Modes hf_paged decodes; the values are the names transformers gives them.
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                   GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE,
                   GenerationMode.ASSISTED_GENERATION)
BEAM_MODES = (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)

# generate() arguments transformers takes that a paged engine cannot honour, and why.
_REFUSED = {
    "assistant_tokenizer": "an assistant of another tokenizer (universal assisted generation) "
                           "is not supported; the assistant must share the model's vocabulary",
    "negative_prompt_ids": "classifier-free guidance is not implemented",
    "negative_prompt_attention_mask": "classifier-free guidance is not implemented",
    "custom_generate": "custom decoding loops run on transformers models only",
    "output_attentions": "the paged attention kernels never materialise attention weights",
    "output_hidden_states": "the engine keeps no per-layer hidden states",
    "past_key_values": "the engine owns the (paged) KV cache",
    "inputs_embeds": "the engine embeds token ids itself",
    "position_ids": "positions follow the attention mask",
}


# The decoding modes GenerationConfig.get_generation_mode() can select that hf_paged does not
# decode: the mode's name, and the fields that select it, so that the error names what the
# caller passed rather than transformers' internal mode (transformers itself would raise for
# some of them that they moved to hub ``custom_generate`` repositories, naming no argument).
_MODE_ARGUMENTS = {
    GenerationMode.CONTRASTIVE_SEARCH: ("contrastive search", ("penalty_alpha", "top_k")),
    GenerationMode.DOLA_GENERATION: ("DoLa decoding", ("dola_layers",)),
    GenerationMode.GROUP_BEAM_SEARCH: ("group beam search", ("num_beam_groups", "num_beams")),
    GenerationMode.CONSTRAINED_BEAM_SEARCH: (
        "constrained beam search", ("constraints", "force_words_ids")),
    GenerationMode.ASSISTED_GENERATION: (
        "assisted generation by multi-token prediction or early exit",
        ("use_mtp", "assistant_early_exit")),
}
_SUPPORTED_TEXT = ("greedy search, sampling (do_sample=True), beam search and beam sampling "
                   "(num_beams > 1) and assisted generation by prompt lookup or an "
                   "assistant model")


def unsupported_mode_message(mode: GenerationMode, config: GenerationConfig) -> str:
    """'penalty_alpha=0.6, top_k=4 (contrastive search) is not supported ...': the fields set
    that selected ``mode``, scalars with their values, lists (constraints) by name alone."""
    name, selectors = _MODE_ARGUMENTS.get(mode, (mode.value.replace("_", " "), ()))
    shown = []
    for field in selectors:
        value = getattr(config, field, None)
        if value is None or (value is False and field != "do_sample"):
            continue  # unset: not what selected the mode
        scalar = isinstance(value, (bool, int, float, str))
        shown.append(f"{field}={value!r}" if scalar else field)
    given = ", ".join(shown) or f"generation mode {mode.value!r}"
    return (f"{given} ({name}) is not supported by hf_paged's generate(); it decodes "
            f"{_SUPPORTED_TEXT}")


class _StandIn(GenerationMixin):
    """Just enough of a transformers model for GenerationMixin's preparation methods."""

    device = torch.device("cpu")

    def __init__(self, config: PretrainedConfig, generation_config: GenerationConfig):
        self.config = config
        self.generation_config = generation_config


@dataclass
class Resolved:
    """One call, prepared as transformers prepares it. ``input_ids`` and ``attention_mask``
    are expanded to ``num_return_sequences`` rows per prompt."""

    config: GenerationConfig
    input_ids: torch.Tensor  # on the CPU
    attention_mask: torch.Tensor
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    device: torch.device  # where the caller's input_ids were
    assistant_model: Any = None  # generate()'s, for assisted generation

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_length - self.input_ids.shape[1]


def resolve(
    hf_config: PretrainedConfig,
    base: GenerationConfig,
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    prefix_allowed_tokens_fn: Any,
    kwargs: dict[str, Any],
) -> Resolved:
    """Merge and validate a call's settings; raise ValueError naming what is unsupported."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(
            "generation_config must be a transformers GenerationConfig, "
            f"got {type(generation_config).__name__}"
        )
    for name, why in _REFUSED.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            raise ValueError(f"{name} is not supported by hf_paged's generate(): {why}")
        kwargs.pop(name, None)
    # transformers pops it first: it only lets hub code run (custom_generate, and the modes
    # moved to hub repositories), which hf_paged refuses by name whatever its value.
    kwargs.pop("trust_remote_code", None)
    assistant = kwargs.pop("assistant_model", None)
    model = _StandIn(hf_config, base)
    tokenizer = kwargs.pop("tokenizer", None)
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and base.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and base.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    for name in ("num_beams", "num_return_sequences"):  # counts of rows: None means 1
        value = getattr(config, name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name, False):
            raise ValueError(f"{name} is not supported by hf_paged's generate(): {_REFUSED[name]}")
    mode = config.get_generation_mode(assistant)
    if mode not in SUPPORTED_MODES or (mode is GenerationMode.ASSISTED_GENERATION and (
            config.use_mtp or config.assistant_early_exit is not None)):
        raise ValueError(unsupported_mode_message(mode, config))
    if config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"guidance_scale is not supported by hf_paged: {_REFUSED['negative_prompt_ids']}")
    if config.token_healing:
        raise ValueError("token_healing is not supported by hf_paged's generate()")

    input_ids = model_kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask = model_kwargs.pop("attention_mask", None)
    refuse_vision_inputs(model_kwargs, "generate()")
    if model_kwargs:
        raise ValueError(
            "generate() got argument(s) hf_paged does not support: "
            f"{', '.join(sorted(model_kwargs))}"
        )
    if input_ids is None:  # transformers starts from BOS alone
        if config.bos_token_id is None:
            raise ValueError("input_ids: none given and the generation config has no bos_token_id")
        input_ids = torch.tensor([[config.bos_token_id]], dtype=torch.long)
    input_ids = _check_input_ids(input_ids)
    device, input_ids = input_ids.device, input_ids.cpu()
    model._prepare_special_tokens(
        config, attention_mask is not None, device=input_ids.device, batch_size=input_ids.shape[0]
    )
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}"
        )
    attention_mask = attention_mask.cpu()
    copies = max(config.num_beams or 1, config.num_return_sequences or 1)
    input_ids = input_ids.repeat_interleave(copies, dim=0)
    attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    width = input_ids.shape[1]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=width,
    )
    model._validate_generated_length(config, width, has_default_max_length)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=width,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor or LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    criteria = model._get_stopping_criteria(
        generation_config=config, stopping_criteria=stopping_criteria or StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    return Resolved(config, input_ids, attention_mask, processors, criteria, device, assistant)


def _check_input_ids(input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a 2-D integer tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(
            f"input_ids must be a 2-D tensor [batch, seq_len], got shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:  # as a tokenizer gives for "" when it adds no BOS
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): generate needs "
                         "a prompt token, or no input_ids at all to start from bos_token_id")
    if input_ids.dtype not in (torch.int16, torch.int32, torch.int64):
        raise ValueError(
            f"input_ids must hold token ids as int16, int32 or int64, got dtype {input_ids.dtype}"
        )
    return input_ids
