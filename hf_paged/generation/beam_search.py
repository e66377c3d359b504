"""A beam-search call (``num_beams > 1``): one ``BeamGroup`` a prompt row
(``generation.beam_groups``) run on the engine, the best finished hypotheses returned as
transformers' generate returns them."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from hf_paged.generation.beam_groups import BeamCohort, BeamGroup, BeamSettings
from hf_paged.generation.settings import Resolved
from hf_paged.sampling_params import SamplingParams


def beam_search(engine, resolved: Resolved, prompts: list[list[int]], pad: int,
                progress_bar: bool | None, adapters: list[str | None] | None = None):
    """Run a resolved beam-search call over ``prompts`` (each row's unpadded prompt; each on
    its LoRA adapter of ``adapters``, None: the base model); returns what transformers'
    generate returns."""
    config = resolved.config
    num_beams = config.num_beams
    if num_beams > engine.config.max_num_seqs:
        raise ValueError(
            f"num_beams ({num_beams}) exceeds the engine's max_num_seqs "
            f"({engine.config.max_num_seqs}): the beams of a prompt run together"
        )
    n = config.num_return_sequences
    if n > num_beams:
        raise ValueError(f"num_return_sequences ({n}) must be at most num_beams ({num_beams})")
    eos = config._eos_token_tensor
    as_dict = bool(config.return_dict_in_generate)
    output_scores = as_dict and bool(config.output_scores)
    output_logits = as_dict and bool(config.output_logits)
    settings = BeamSettings(
        num_beams=num_beams,
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        max_new_tokens=resolved.max_new_tokens,
        eos_token_ids=() if eos is None else tuple(eos.tolist()),
        keep_rows=output_scores or output_logits,
        do_sample=bool(config.do_sample),
    )
    cohort = BeamCohort(resolved, settings, pad)
    params = SamplingParams(max_new_tokens=resolved.max_new_tokens,
                            eos_token_ids=settings.eos_token_ids, hooks=cohort)
    rows = [params if adapters is None else replace(params, adapter=adapters[row])
            for row in range(len(prompts))]
    for prompt, row_params in zip(prompts, rows):
        engine.validate_request(prompt, row_params)
    cohort.groups = groups = [BeamGroup(engine.add_request(p, rows[row]), row, settings, cohort)
                              for row, p in enumerate(prompts)]
    engine.run([g.root for g in groups], progress_bar)
    # transformers fills with ``pad_token_id or eos_token_id[0]`` (-1 without an EOS id).
    fill = (config._pad_token_tensor or eos[0]) if eos is not None else -1
    sequences, beam_indices = _best(cohort.prompt_ids, groups, n, int(fill))
    sequences = sequences.to(resolved.device)
    if not as_dict:
        return sequences
    steps, device = cohort.num_steps, engine.device  # transformers' loop ran ``steps`` times

    def per_step(rows_of):
        return tuple(torch.cat([rows_of(g)[t] for g in groups]).to(device) for t in range(steps))

    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=torch.tensor([h.score for g in groups for h in g.finished[:n]],
                                      dtype=torch.float32, device=device)
        if output_scores else None,
        scores=per_step(lambda g: g.score_rows) if output_scores else None,
        logits=per_step(lambda g: g.logit_rows) if output_logits else None,
        beam_indices=beam_indices.to(device),
    )


def _best(prompt_ids: torch.Tensor, groups: list[BeamGroup], n: int, fill: int):
    """The best ``n`` finished hypotheses of each row after its padded prompt, ``fill`` past
    their end (int64, as transformers' running sequences), and their beam indices (-1 past
    their end)."""
    best = [h for g in groups for h in g.finished[:n]]
    width = max(len(h.tokens) for h in best)
    new = torch.full((len(best), width), fill, dtype=torch.long)
    beam_indices = torch.full((len(best), width), -1, dtype=torch.int32)
    for i, h in enumerate(best):
        new[i, : len(h.tokens)] = torch.tensor(h.tokens)
        beam_indices[i, : len(h.tokens)] = torch.tensor(h.beam_indices, dtype=torch.int32)
    prompts = prompt_ids.repeat_interleave(n, dim=0).long()
    return torch.cat([prompts, new], dim=1), beam_indices
