"""The transformers-shaped ``generate()``: padded tensors in, padded tensors out.

It follows ``GenerationMixin.generate``: the engine's (checkpoint's) GenerationConfig, updated
by the call's ``generation_config`` and keyword arguments; ``max_length`` counting the padded
prompt width; the attention mask inferred from ``pad_token_id`` when not given; output rows of
prompt (with its padding) plus new tokens, rows that stopped early filled with
``pad_token_id``. Arguments that would change the result and are not implemented raise.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from hf_paged.sampling_params import from_generation_config

# GenerationConfig fields that hf_paged honours, or that do not change what is generated.
_SUPPORTED_FIELDS = {
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
    "transformers_version", "_from_model_config", "_commit_hash", "generation_kwargs",
}
_ENGINE_KWARGS = {"progress_bar"}
# Honoured with num_beams > 1 only (beam search, ``hf_paged.beam_search``).
_BEAM_FIELDS = {
    "num_beams", "length_penalty", "early_stopping", "num_return_sequences",
    "return_dict_in_generate", "output_scores", "output_logits",
}


def generate(engine, input_ids, attention_mask=None, generation_config=None, **kwargs):
    """Generate like ``model.generate(...)`` and return a LongTensor of prompt plus new tokens."""
    if "inputs" in kwargs and input_ids is None:
        input_ids = kwargs.pop("inputs")
    progress_bar = kwargs.pop("progress_bar", None)
    config = _merged_config(engine.generation_config, generation_config, kwargs)
    input_ids = _check_input_ids(input_ids)
    width = input_ids.shape[1]
    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    else:
        max_new_tokens = config.max_length - width
        if max_new_tokens <= 0:
            raise ValueError(
                f"max_length ({config.max_length}) must exceed the input width ({width}); "
                "raise max_length or set max_new_tokens"
            )
    params = from_generation_config(config, max_new_tokens)
    pad = config.pad_token_id
    if pad is None and params.eos_token_ids:
        pad = params.eos_token_ids[0]  # transformers does the same
    mask = _attention_mask(input_ids, attention_mask, pad, params.eos_token_ids)
    prompts = _unpadded_rows(input_ids, mask)
    if config.num_beams > 1:
        return _beam_search(engine, input_ids, prompts, params, config, progress_bar)
    seqs = engine._add_all(prompts, params)
    engine.run(seqs, progress_bar)
    return _pad_outputs(input_ids, [s.output_token_ids for s in seqs], pad)


def _merged_config(base: GenerationConfig, passed, kwargs: dict) -> GenerationConfig:
    if passed is not None and not isinstance(passed, GenerationConfig):
        raise ValueError(
            "generation_config must be a transformers GenerationConfig, "
            f"got {type(passed).__name__}"
        )
    config = copy.deepcopy(passed if passed is not None else base)
    unknown = config.update(**kwargs)
    if unknown:
        raise ValueError(
            f"generate() got argument(s) hf_paged does not support: {', '.join(sorted(unknown))}"
        )
    default = GenerationConfig()
    beams = isinstance(config.num_beams, int) and config.num_beams > 1
    supported = _SUPPORTED_FIELDS | _BEAM_FIELDS if beams else _SUPPORTED_FIELDS
    for name, value in config.to_dict().items():
        inactive = value is None or value is False or value == getattr(default, name, None)
        if name not in supported and not inactive:
            raise ValueError(
                f"{name}={value!r} is not supported by hf_paged's generate() (supported: "
                f"{', '.join(sorted(n for n in _SUPPORTED_FIELDS if not n.startswith('_')))})"
            )
    # Unset beam fields take transformers' global defaults, as its generate() does.
    defaults = GenerationConfig._get_default_generation_params()
    for name in _BEAM_FIELDS & defaults.keys():
        if getattr(config, name) is None:
            setattr(config, name, defaults[name])
    if beams:
        _check_beam_fields(config)
    if config.use_cache is False:
        raise ValueError("use_cache=False is not supported: the paged KV cache is always on")
    if config.temperature is not None and config.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {config.temperature!r}")
    if config.top_p is not None and not 0.0 < config.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {config.top_p!r}")
    return config


def _check_beam_fields(config: GenerationConfig) -> None:
    if config.do_sample:
        raise ValueError("do_sample=True with num_beams > 1 (beam sampling) is not supported")
    n = config.num_return_sequences
    if not isinstance(n, int) or not 1 <= n <= config.num_beams:
        raise ValueError(
            f"num_return_sequences must be an integer from 1 to num_beams ({config.num_beams}), "
            f"got {n!r}"
        )
    if config.early_stopping not in (True, False, "never"):
        raise ValueError(
            f"early_stopping must be True, False or 'never', got {config.early_stopping!r}"
        )
    if not isinstance(config.length_penalty, (int, float)):
        raise ValueError(f"length_penalty must be a number, got {config.length_penalty!r}")


def _beam_search(engine, input_ids, prompts, params, config, progress_bar):
    """Beam search over the unpadded ``prompts``; outputs as transformers' ``_beam_search``."""
    from hf_paged.beam_search import BeamSettings, add_beam_requests, beam_outputs

    as_dict = bool(config.return_dict_in_generate)
    settings = BeamSettings(
        num_beams=config.num_beams,
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        max_new_tokens=params.max_new_tokens,
        eos_token_ids=params.eos_token_ids,
        keep_rows=as_dict and bool(config.output_scores or config.output_logits),
    )
    groups = add_beam_requests(engine, prompts, params, settings)
    engine.run([g.root for g in groups], progress_bar)
    eos = params.eos_token_ids
    # transformers fills with ``pad_token_id or eos_token_id[0]`` (-1 without an EOS id).
    fill = (config.pad_token_id or eos[0]) if eos else -1
    return beam_outputs(input_ids, groups, config.num_return_sequences, fill, as_dict,
                        bool(config.output_scores), bool(config.output_logits))


def _check_input_ids(input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a 2-D integer tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(
            f"input_ids must be a 2-D tensor [batch, seq_len], got shape {tuple(input_ids.shape)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    return input_ids


def _attention_mask(input_ids, attention_mask, pad, eos_ids) -> torch.Tensor:
    if attention_mask is None:
        # transformers infers the mask only when the pad token is present and is not an EOS.
        if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
            return input_ids.ne(pad)
        return torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}"
        )
    return attention_mask.bool()


def _unpadded_rows(input_ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    rows = []
    for i, (ids, keep) in enumerate(zip(input_ids.tolist(), mask.tolist())):
        first = keep.index(True) if True in keep else len(keep)
        if not all(keep[first:]):
            raise ValueError(
                f"attention_mask: row {i} is not left-padded (a 0 follows a 1); "
                "use tokenizer(..., padding_side='left')"
            )
        rows.append(ids[first:])
    return rows


def _pad_outputs(input_ids: torch.Tensor, outputs: list[list[int]], pad: int | None):
    longest = max(len(o) for o in outputs)
    # Rows stop early only at an EOS, and then pad is set; without one every row is full.
    new = torch.full((len(outputs), longest), pad or 0, dtype=input_ids.dtype)
    for i, o in enumerate(outputs):
        new[i, : len(o)] = torch.tensor(o, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)
