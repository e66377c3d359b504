"""A draft model's engine beside a target's: its options, its checks, and one built from
``EngineConfig.speculative_model`` (a checkpoint). ``generate(assistant_model=...)`` finds or
builds its draft engine with these (``hf_paged.generation.assisted``).

A built engine fits beside the target: the same block size, batch limits, graphs and
attention backend, the target's ``max_model_len`` (the draft checkpoint's, where shorter), in
the target's dtype and on its device. It serves at most ``speculative_max_batch`` sequences
(more requests than that never speculate), so its decode graphs and its cache stop there: on a
GPU the cache takes what memory the target left, up to ``DRAFT_MEMORY_UTILIZATION`` of the
device (or the target's ``gpu_memory_utilization``, if higher), as any engine sizes its cache;
on the CPU it has as many blocks as the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AutoConfig, PretrainedConfig

from hf_paged.config import EngineConfig
from hf_paged.engine.loading import resolve_checkpoint
from hf_paged.engine.speculation.draft_proposer import DraftEngine
from hf_paged.families.vision_language import causal_lm_config
from hf_paged.step import WorkerSpec
from hf_paged.worker.executor import check_spec

# The share of the GPU's memory, the target's included, a draft engine may fill: the target
# sized its cache within its own ``gpu_memory_utilization`` (0.9 by default), so the draft
# takes what it left, keeping a margin for the CUDA context and other allocations.
DRAFT_MEMORY_UTILIZATION = 0.95


def draft_options(config: EngineConfig, max_model_len: int, num_blocks: int,
                  device: torch.device) -> dict:
    """Engine options for a draft engine beside a target of ``config``, ``max_model_len``
    and ``num_blocks`` KV blocks, on ``device``."""
    if device.type == "cuda":  # sized from the memory the target left (startup caps it)
        memory = dict(gpu_memory_utilization=max(config.gpu_memory_utilization,
                                                 DRAFT_MEMORY_UTILIZATION))
    else:
        memory = dict(num_kv_blocks=num_blocks)
    return dict(
        block_size=config.block_size, max_model_len=max_model_len, **memory,
        max_num_seqs=min(config.speculative_max_batch, config.max_num_seqs),
        max_num_batched_tokens=config.max_num_batched_tokens,
        enforce_eager=config.enforce_eager, attention_backend=config.attention_backend,
        enable_prefix_caching=config.enable_prefix_caching, kv_cache_dtype=config.kv_cache_dtype,
    )


def draft_engine_from_checkpoint(path: str, build: Callable[..., DraftEngine], *,
                                 dtype: torch.dtype, device: torch.device, config: EngineConfig,
                                 max_model_len: int, num_blocks: int,
                                 vocab_size: int | None = None) -> DraftEngine:
    """A draft engine of the checkpoint ``path`` (a folder or a hub id) beside a target of
    ``config``, ``max_model_len`` and ``num_blocks`` KV blocks, in ``dtype`` on ``device``,
    made by ``build`` (``EngineCore.from_pretrained``). ``vocab_size``: the target's, checked
    when given."""
    path = resolve_checkpoint(path)
    hf_config = causal_lm_config(AutoConfig.from_pretrained(path))
    check_vocab("speculative_model", hf_config, vocab_size)
    options = draft_options(config, draft_length(hf_config, max_model_len), num_blocks,
                            torch.device(device))
    return load_draft("speculative_model", build, path, dtype=dtype, device=device,
                      hf_config=hf_config, **options)


def check_draft(name: str, hf_config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device, options: dict, max_model_len: int) -> None:
    """Raise ValueError naming ``name`` when a model of ``hf_config`` cannot serve as a draft
    engine of ``options`` (a family hf_paged serves, on the target's device)."""
    try:
        check_spec(WorkerSpec(hf_config, "", dtype, device, EngineConfig(**options),
                              max_model_len))
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def load_draft(name: str, build: Callable[..., DraftEngine], path: str, **options
               ) -> DraftEngine:
    """``build(path, **options)``: a draft engine; a cache that finds no memory names the
    argument ``name`` that asked for it."""
    try:
        engine = build(path, **options)
    except ValueError as error:
        if "no memory is left for the KV cache" not in str(error):
            raise
        raise ValueError(f"{name}: no GPU memory is left for the draft model's KV cache; load "
                         "the model with a lower gpu_memory_utilization") from None
    try:
        check_truncatable(name, engine)
    except ValueError:
        engine.close()
        raise
    return engine


def check_truncatable(name: str, engine: DraftEngine) -> None:
    """Raise ValueError naming ``name`` when ``engine``'s model cannot draft: a draft sequence
    is cut back to its request's tokens, which a hybrid model's linear-attention state cannot
    follow."""
    if engine.block_manager.state_slots is not None:
        raise ValueError(f"{name}: the model has linear-attention layers, whose state cannot "
                         "be cut back to a request's tokens; it cannot draft")


def check_vocab(name: str, config: PretrainedConfig | None, vocab_size: int | None) -> None:
    """Raise ValueError naming ``name`` unless ``config``'s vocabulary is ``vocab_size``."""
    vocab = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab != vocab_size:
        raise ValueError(
            f"{name} has a vocabulary of {vocab} tokens, the model {vocab_size}: a draft model "
            "must share the model's tokenizer (universal assisted generation with "
            "assistant_tokenizer is not supported)")


def draft_length(config: PretrainedConfig, max_model_len: int) -> int:
    """The target's longest sequence, or the draft model's when shorter."""
    return min(max_model_len, config.max_position_embeddings)
