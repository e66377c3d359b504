"""A draft model's engine beside a target's: from ``generate(assistant_model=...)`` (an
hf_paged model's own engine, or one built once from a stock transformers model) or from
``EngineConfig.speculative_model`` (a checkpoint).

A built engine fits beside the target: the same block size, batch limits, graphs and
attention backend, the target's ``max_model_len`` (the draft checkpoint's, where shorter), in
the target's dtype and on its device. It serves at most ``speculative_max_batch`` sequences
(more requests than that never speculate), so its decode graphs and its cache stop there: on a
GPU the cache takes what memory the target left, up to ``DRAFT_MEMORY_UTILIZATION`` of the
device (or the target's ``gpu_memory_utilization``, if higher), as any engine sizes its cache;
on the CPU it has as many blocks as the target's.
"""

from __future__ import annotations

import tempfile
import weakref
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from hf_paged.config import EngineConfig
from hf_paged.engine.engine import EngineCore
from hf_paged.engine.loading import resolve_checkpoint
from hf_paged.step import WorkerSpec
from hf_paged.worker.executor import check_spec


@dataclass
class _Built:
    """An engine built from an assistant model, for targets of these options."""

    key: tuple
    engine: EngineCore
    finalizer: weakref.finalize  # closes the engine once the model is collected


# The share of the GPU's memory, the target's included, a draft engine may fill: the target
# sized its cache within its own ``gpu_memory_utilization`` (0.9 by default), so the draft
# takes what it left, keeping a margin for the CUDA context and other allocations.
DRAFT_MEMORY_UTILIZATION = 0.95

# Engines built from stock assistant models, by model: repeated generate() calls reuse them.
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def draft_engine_from_checkpoint(path: str, *, dtype: torch.dtype, device: torch.device,
                                 config: EngineConfig, max_model_len: int, num_blocks: int,
                                 vocab_size: int | None = None) -> EngineCore:
    """A draft engine of the checkpoint ``path`` (a folder or a hub id) beside a target of
    ``config``, ``max_model_len`` and ``num_blocks`` KV blocks, in ``dtype`` on ``device``.
    ``vocab_size``: the target's, checked when given."""
    path = resolve_checkpoint(path)
    hf_config = AutoConfig.from_pretrained(path)
    _check_vocab("speculative_model", hf_config, vocab_size)
    options = draft_options(config, _length(hf_config, max_model_len), num_blocks,
                            torch.device(device))
    return _load("speculative_model", path, dtype=dtype, device=device, hf_config=hf_config,
                 **options)


def draft_engine_for(assistant_model: object, target: EngineCore) -> tuple[EngineCore, bool]:
    """The engine that drafts for ``target`` with ``assistant_model``, and whether the caller
    owns it (closes it when done with it).

    An hf_paged model drafts on its own engine (on the target's device; the target's own when
    it is the model itself).
    A stock transformers model of a family hf_paged serves is saved and loaded into a new
    engine beside the target (``draft_options``), once: the engine is kept for the model, and
    reused while the target's options stay the same, so the caller does not own it; it is
    closed once the model is collected. Its weights are those of the model when it was built:
    changing the model's parameters afterwards is not seen. Raises ValueError naming
    ``assistant_model`` for a model that cannot draft for ``target``.
    """
    engine = (assistant_model if isinstance(assistant_model, EngineCore)
              else getattr(assistant_model, "engine", None))
    own_engine = isinstance(engine, EngineCore)
    if not own_engine and not isinstance(assistant_model, PreTrainedModel):
        raise ValueError("assistant_model must be an hf_paged or transformers causal language "
                         f"model, got {type(assistant_model).__name__}")
    config = engine.hf_config if own_engine else assistant_model.config
    _check_vocab("assistant_model", config, target.hf_config.vocab_size)
    if own_engine:
        if engine.closed:
            raise ValueError("assistant_model was closed; load it again")
        # The model as its own assistant (transformers allows it) drafts on its own engine:
        # draft steps run between its steps, whose tokens are then all collected, and its
        # draft sequences share the prompts' blocks through the prefix cache.
        if engine.device != target.device:
            raise ValueError(f"assistant_model is on {engine.device}, the model on "
                             f"{target.device}: the assistant must be on the model's device")
        return engine, False
    max_model_len = _length(config, target.max_model_len)
    options = draft_options(target.config, max_model_len, target.block_manager.num_blocks,
                            target.device)
    try:  # before anything is saved: a family hf_paged serves, on the target's device
        check_spec(WorkerSpec(config, "", target.dtype, target.device,
                              EngineConfig(**options), max_model_len))
    except ValueError as error:
        raise ValueError(f"assistant_model: {error}") from None
    key = (target.device, target.dtype, tuple(sorted(options.items())))
    built = _BUILT.get(assistant_model)
    if built is not None and built.key == key and not built.engine.closed:
        return built.engine, False
    if built is not None:  # built beside a target of other options
        built.finalizer()
    with tempfile.TemporaryDirectory() as folder:
        assistant_model.save_pretrained(folder)
        engine = _load("assistant_model", folder, dtype=target.dtype, device=target.device,
                       **options)
    finalizer = weakref.finalize(assistant_model, engine.close)
    finalizer.atexit = False  # at exit the process frees everything anyway
    _BUILT[assistant_model] = _Built(key, engine, finalizer)
    return engine, False


def _load(name: str, path: str, **options) -> EngineCore:
    """A draft engine; a cache that finds no memory names the argument that asked for it."""
    try:
        engine = EngineCore.from_pretrained(path, **options)
    except ValueError as error:
        if "no memory is left for the KV cache" not in str(error):
            raise
        raise ValueError(f"{name}: no GPU memory is left for the draft model's KV cache; load "
                         "the model with a lower gpu_memory_utilization") from None
    return engine


def _check_vocab(name: str, config: PretrainedConfig | None, vocab_size: int | None) -> None:
    vocab = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab != vocab_size:
        raise ValueError(
            f"{name} has a vocabulary of {vocab} tokens, the model {vocab_size}: a draft model "
            "must share the model's tokenizer (universal assisted generation with "
            "assistant_tokenizer is not supported)")


def _length(config: PretrainedConfig, max_model_len: int) -> int:
    """The target's longest sequence, or the draft model's when shorter."""
    return min(max_model_len, config.max_position_embeddings)
