"""The integration tests use the tiny checkpoint with a tokenizer (``tiny_checkpoint``,
``tokenizer``, ``stock_model``) and the engine options ``SMALL`` of ``tests/conftest.py``;
``SMALL`` stays importable from here."""

from tests.conftest import SMALL

__all__ = ["SMALL"]
