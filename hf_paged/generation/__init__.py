"""The transformers-shaped ``generate()`` (see ``generate.py``)."""

from hf_paged.generation.generate import generate

__all__ = ["generate"]
