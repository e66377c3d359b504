"""The transformers-shaped ``generate()``: padded tensors in, transformers' outputs out.

Settings, processors and stopping criteria come from transformers' own preparation code
(``settings``). Each row of the (expanded) batch becomes one engine request; what the engine
does natively (EOS lists, length, repetition penalty, temperature / top-k / top-p) stays on
its fast path, and a ``CallHooks`` object carries the rest of the call (other processors,
stopping criteria, recorded scores) for all of its rows together.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from hf_paged.generation import assisted
from hf_paged.generation import processors as procs
from hf_paged.generation.beam_search import beam_search
from hf_paged.generation.call_hooks import CallHooks
from hf_paged.generation.masked_rows import first_tokens
from hf_paged.generation.outputs import decoder_only_output, pad_outputs, per_step
from hf_paged.generation.settings import BEAM_MODES, resolve
from hf_paged.generation.streaming import StreamFeeder
from hf_paged.sampling_params import SamplingParams

BASE = "__base__"  # peft's name for the base model among ``adapter_names``


def generate(
    engine,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus: bool | None = None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids=None,
    negative_prompt_attention_mask=None,
    custom_generate=None,
    **kwargs,
):
    """``GenerationMixin.generate`` over the engine; returns what transformers returns."""
    if synced_gpus:
        raise ValueError("synced_gpus is not supported: hf_paged runs one engine per model")
    _check_streamer(streamer)
    progress_bar = kwargs.pop("progress_bar", None)
    adapter_names = kwargs.pop("adapter_names", None)
    kwargs.update(assistant_model=assistant_model, negative_prompt_ids=negative_prompt_ids,
                  negative_prompt_attention_mask=negative_prompt_attention_mask,
                  custom_generate=custom_generate)
    resolved = resolve(engine.hf_config, engine.generation_config, inputs, generation_config,
                       logits_processor, stopping_criteria, prefix_allowed_tokens_fn, kwargs)
    config = resolved.config
    pad_tensor = config._pad_token_tensor
    pad = int(pad_tensor) if pad_tensor is not None else 0
    prompts = _unpadded_rows(resolved.input_ids, resolved.attention_mask.bool())
    adapters = row_adapters(adapter_names, len(prompts), inputs)
    empty = [row for row, prompt in enumerate(prompts) if not prompt]
    if empty and resolved.input_ids.shape[1] == 1 \
            and engine.block_manager.state_slots is not None:
        # transformers zeroes no padding in a one-token forward: the masked token enters the
        # linear layers' state, while attention leaves it out; the engine runs one or the other
        raise ValueError(f"attention_mask: row {empty[0]} keeps no token of a one-token prompt; "
                         f"{engine.hf_config.model_type}'s linear-attention layers would still "
                         "read that token in transformers, which hf_paged does not follow")
    if empty and adapters is not None and any(adapters[row] for row in empty):
        raise ValueError(f"attention_mask: row {empty[0]} keeps no token; a fully masked row "
                         "cannot run on a LoRA adapter")
    if config.get_generation_mode() in BEAM_MODES:
        if streamer is not None:  # as transformers
            raise ValueError("streamer cannot be used with beam search: set num_beams=1")
        if empty:
            raise ValueError(f"attention_mask: row {empty[0] // config.num_beams} keeps no token; "
                             "hf_paged's beam search needs at least one unmasked prompt token")
        return beam_search(engine, resolved, prompts[:: config.num_beams], pad, progress_bar,
                           None if adapters is None else adapters[:: config.num_beams])
    record_scores = bool(config.return_dict_in_generate and config.output_scores)
    record_logits = bool(config.return_dict_in_generate and config.output_logits)
    lockstep = record_scores or record_logits
    # Length and EOS are the engine's own checks, except in lockstep where EOS marks done.
    native = (MaxLengthCriteria,) if lockstep else (MaxLengthCriteria, EosTokenCriteria)
    criteria = StoppingCriteriaList(c for c in resolved.criteria if type(c) not in native)
    split = _split(resolved, lockstep)
    hooks = None
    if split.rest or criteria or lockstep:
        hooks = CallHooks(resolved, split.rest, criteria, pad, record_scores, record_logits)
    with assisted.speculating(engine, resolved) as speculation:
        params = _sampling_params(resolved, split, lockstep, hooks, speculation)
        if adapters is not None:
            params = [replace(params, adapter=name) for name in adapters]
        chunks = speculation is not None and resolved.input_ids.shape[0] == 1
        feeder = StreamFeeder(streamer, pad, chunks) if streamer is not None else None
        if feeder:
            feeder.start(resolved.input_ids)
        first = {}
        if empty:  # transformers' first step for them, then the engine goes on from it
            tokens, logits, scores = first_tokens(engine, resolved, empty, config.do_sample)
            first = dict(zip(empty, tokens))
            for i, row in enumerate(empty):
                if record_logits:
                    hooks.logits[row].append(logits[i].cpu())
                if record_scores:
                    hooks.scores[row].append(scores[i].cpu())
        seqs = _add_requests(engine, prompts, params, config.num_return_sequences or 1, first)
        if hooks:
            hooks.attach(seqs, engine.device)
        engine.run(seqs, progress_bar, on_step=feeder.feed if feeder else None)
        assisted.finish(resolved, speculation, seqs)
        if feeder:
            feeder.feed(seqs)
            feeder.end()
        outputs = [s.output_token_ids for s in seqs]
        if lockstep:  # transformers' loop ran until the last row was done
            steps = min(max(len(hooks.scores[r] or hooks.logits[r]) for r in range(len(seqs))),
                        max(len(o) for o in outputs))
            outputs = [o[:steps] for o in outputs]
        # Sequences stay where the caller's input_ids were; scores and logits are the model's.
        sequences = pad_outputs(resolved.input_ids, outputs, pad).to(resolved.device)
        if not config.return_dict_in_generate:
            return sequences
        steps = sequences.shape[1] - resolved.input_ids.shape[1]
        return decoder_only_output(
            sequences,
            scores=per_step(hooks.scores, steps, engine.device) if record_scores else None,
            logits=per_step(hooks.logits, steps, engine.device) if record_logits else None,
        )


def check(engine, inputs: torch.Tensor | None = None, generation_config=None,
          streamer=None, **kwargs) -> None:
    """Raise the ValueError that ``generate`` would raise for this call (its settings, its
    sampling values, a prompt or length the engine cannot fit), queueing nothing: a server
    can then refuse a request before its response starts, rather than from inside it."""
    _check_streamer(streamer)
    if kwargs.pop("synced_gpus", None):
        raise ValueError("synced_gpus is not supported: hf_paged runs one engine per model")
    kwargs.pop("progress_bar", None)
    adapter_names = kwargs.pop("adapter_names", None)
    resolved = resolve(engine.hf_config, engine.generation_config, inputs, generation_config,
                       kwargs.pop("logits_processor", None), kwargs.pop("stopping_criteria", None),
                       kwargs.pop("prefix_allowed_tokens_fn", None), kwargs)
    config = resolved.config
    prompts = _unpadded_rows(resolved.input_ids, resolved.attention_mask.bool())
    if config.get_generation_mode() in BEAM_MODES and streamer is not None:
        raise ValueError("streamer cannot be used with beam search: set num_beams=1")
    lockstep = bool(config.return_dict_in_generate
                    and (config.output_scores or config.output_logits))
    params = _sampling_params(resolved, _split(resolved, lockstep), lockstep, None)
    adapters = row_adapters(adapter_names, len(prompts), inputs) or [None] * len(prompts)
    for prompt, adapter in zip(prompts, adapters):
        if prompt:  # a fully masked row starts from transformers' first token instead
            engine.validate_request(prompt, replace(params, adapter=adapter))


def _check_streamer(streamer) -> None:
    if streamer is not None and not all(callable(getattr(streamer, m, None))
                                        for m in ("put", "end")):
        raise ValueError("streamer must have put() and end() methods (a transformers BaseStreamer)")


def _split(resolved, lockstep: bool) -> procs.Split:
    padded = not bool(resolved.attention_mask.bool().all())
    return procs.split(resolved.processors, padded, keep_all=lockstep)


def _sampling_params(resolved, split: procs.Split, lockstep: bool, hooks,
                     speculation=None) -> SamplingParams:
    """The engine's settings for each row of the call (SamplingParams validates them)."""
    config = resolved.config
    eos = config._eos_token_tensor
    return SamplingParams(
        max_new_tokens=resolved.max_new_tokens,
        temperature=split.temperature if config.do_sample else 0.0,
        top_k=split.top_k,
        top_p=split.top_p,
        min_p=split.min_p,
        repetition_penalty=split.repetition_penalty,
        eos_token_ids=() if eos is None else tuple(eos.tolist()),
        ignore_eos=lockstep,
        hooks=hooks,
        speculation=speculation,
    )


def _add_requests(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                  copies: int, first: dict[int, int]):
    """One request per (expanded) row (``params``: one for all, or one per row); the
    ``copies`` rows of one prompt prefill it once and share its KV blocks when the engine can
    run them together. A row of ``first`` (its first token, drawn already) continues from
    that token."""
    rows = params if isinstance(params, list) else [params] * len(prompts)
    if first:
        for row, prompt in enumerate(prompts):  # all checked before any is queued
            engine.validate_request(prompt or [first[row]], rows[row])
        return [engine.add_request(prompt, rows[row], output_token_ids=[first[row]]
                                   if not prompt else ()) for row, prompt in enumerate(prompts)]
    if copies == 1 or copies > engine.config.max_num_seqs:
        return engine.add_requests(prompts, rows)
    for prompt, row_params in zip(prompts[::copies], rows[::copies]):  # all checked first
        engine.validate_request(prompt, row_params)
    return [seq for prompt, row_params in zip(prompts[::copies], rows[::copies])
            for seq in engine.add_forked_requests(prompt, row_params, copies)]


def row_adapters(adapter_names, rows: int, inputs) -> list[str | None] | None:
    """peft's ``adapter_names`` (one per input row; ``"__base__"``: the base model) for each
    of the ``rows`` rows expanded from them (``num_return_sequences``, beams)."""
    if adapter_names is None:
        return None
    if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
        raise ValueError(f"adapter_names must be a list of adapter names, one per input row, "
                         f"got {adapter_names!r}")
    if not adapter_names or rows % len(adapter_names):
        batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) else "the"
        raise ValueError(f"adapter_names: {len(adapter_names)} names for {batch} input rows "
                         f"(one per row)")
    copies = rows // len(adapter_names)
    return [None if name in (None, BASE) else name
            for name in adapter_names for _ in range(copies)]


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
