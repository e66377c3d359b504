"""``PagedEngine``: the engine core with transformers' ``generate`` on it."""

from __future__ import annotations

from hf_paged.engine.engine import EngineCore
from hf_paged.generation.generate import generate


class PagedEngine(EngineCore):
    """A model served by continuous batching over a paged KV cache.

    Build it with ``hf_paged.from_pretrained``. ``generate`` mirrors transformers'
    ``GenerationMixin.generate``; ``generate_tokens`` takes token-id lists with per-request
    ``SamplingParams``; ``add_request``/``add_requests``/``step`` drive the engine by hand.

    Under torchrun with ``tensor_parallel_size > 1`` every rank holds an engine and makes the
    same calls; rank 0's schedules and samples, the others follow its steps inside ``run``
    (so ``generate``/``generate_tokens``) and return its results. Only rank 0 may ``step``.
    """

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """``GenerationMixin.generate`` on the engine: the same arguments and return values;
        see ``hf_paged.generation``."""
        return generate(self, inputs, generation_config, **kwargs)
