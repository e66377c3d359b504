"""The engine an ``assistant_model`` drafts on: an hf_paged model's own engine, or one built
once from a stock transformers model and kept for it."""

from __future__ import annotations

import tempfile
import weakref
from dataclasses import dataclass

from transformers import PreTrainedModel

from hf_paged.engine.engine import EngineCore
from hf_paged.engine.speculation.draft_engine import (
    check_draft,
    check_truncatable,
    check_vocab,
    draft_length,
    draft_options,
    load_draft,
)


@dataclass
class _Built:
    """An engine built from an assistant model, for targets of these options."""

    key: tuple
    engine: EngineCore
    finalizer: weakref.finalize  # closes the engine once the model is collected


# Engines built from stock assistant models, by model: repeated generate() calls reuse them.
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    check_vocab("assistant_model", config, target.hf_config.vocab_size)
    if own_engine:
        if engine.closed:
            raise ValueError("assistant_model was closed; load it again")
        # The model as its own assistant (transformers allows it) drafts on its own engine:
        # draft steps run between its steps, whose tokens are then all collected, and its
        # draft sequences share the prompts' blocks through the prefix cache.
        if engine.device != target.device:
            raise ValueError(f"assistant_model is on {engine.device}, the model on "
                             f"{target.device}: the assistant must be on the model's device")
        check_truncatable("assistant_model", engine)
        return engine, False
    max_model_len = draft_length(config, target.max_model_len)
    options = draft_options(target.config, max_model_len, target.block_manager.num_blocks,
                            target.device)
    # Before anything is saved: a family hf_paged serves, on the target's device.
    check_draft("assistant_model", config, target.dtype, target.device, options, max_model_len)
    key = (target.device, target.dtype, tuple(sorted(options.items())))
    built = _BUILT.get(assistant_model)
    if built is not None and built.key == key and not built.engine.closed:
        return built.engine, False
    if built is not None:  # built beside a target of other options
        built.finalizer()
    with tempfile.TemporaryDirectory() as folder:
        assistant_model.save_pretrained(folder)
        engine = load_draft("assistant_model", EngineCore.from_pretrained, folder,
                            dtype=target.dtype, device=target.device, **options)
    finalizer = weakref.finalize(assistant_model, engine.close)
    finalizer.atexit = False  # at exit the process frees everything anyway
    _BUILT[assistant_model] = _Built(key, engine, finalizer)
    return engine, False
