"""Kernel dispatch (placeholder until the Triton kernels land): reference versions only."""

from hf_paged.kernels.reference import (  # noqa: F401
    add_rms_norm,
    paged_attention,
    rms_norm,
    rope,
    sample,
    silu_and_mul,
    store_kv,
)
