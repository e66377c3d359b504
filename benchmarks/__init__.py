"""Benchmarks of hf_paged against stock transformers; run them as ``python -m benchmarks.NAME``."""
