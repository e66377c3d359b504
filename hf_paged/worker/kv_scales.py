"""The scales of an FP8 KV cache where the checkpoint ships none: calibrated at start-up.

The rule is vLLM's ``calculate_kv_scales``: a scale is the largest magnitude of the keys
(values) seen in a forward divided by 200 (100), its ``K_SCALE_CONSTANT`` and
``V_SCALE_CONSTANT``, which leaves keys 2.24 times and values 4.48 times that maximum before
they saturate at e4m3's 448. vLLM takes its maximum over the first forward it runs; here one
prefill of ``CALIBRATION_TOKENS`` fixed pseudo-random tokens (seeded, drawn over the whole
vocabulary) runs at start-up on a scratch cache in the model's dtype, and the maxima are taken
per layer and KV head from what it stored. So the scales depend on the checkpoint alone (not
on whichever request comes first), they exist before the CUDA graphs that read them are
captured, and each KV head uses e4m3's range for its own values: vLLM's default scale of 1.0
would put small values (those of a randomly initialised model, around 1e-2) among e4m3's
subnormals, below 2**-6, where the rounding error exceeds the 6% of its normal numbers.
"""

from __future__ import annotations

import torch

from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.paged_model import PagedModel

CALIBRATION_TOKENS = 512
K_RANGE, V_RANGE = 200.0, 100.0


def _scale(cache: torch.Tensor, num_tokens: int, value_range: float) -> torch.Tensor:
    """Per KV head: the largest magnitude among the first ``num_tokens`` stored rows over
    ``value_range`` (1.0 for a head that stored only zeros)."""
    amax = cache.flatten(0, 1)[:num_tokens].float().abs().amax(dim=(0, 2))
    return torch.where(amax > 0, amax / value_range, 1.0)


@torch.inference_mode()
def calibrate(model: PagedModel, block_size: int, max_model_len: int) -> None:
    """Set every attention layer's ``k_scale`` / ``v_scale`` (in place) from one calibration
    prefill of at most ``max_model_len`` tokens."""
    layers = model.attention_layers
    weight = model.embed_tokens.weight
    device = weight.device
    n = min(CALIBRATION_TOKENS, max_model_len)
    blocks = -(-n // block_size)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.vocab_size, (n,), generator=generator).to(device)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        max_query_len=n,
    )
    if model.state_modules:  # a hybrid model's linear layers: slot 0, from zeros (start-up)
        meta.state_slots = torch.zeros(1, dtype=torch.int32, device=device)
        meta.has_initial_state = torch.zeros(1, dtype=torch.bool, device=device)
    shape = (blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    try:
        for layer in layers:
            layer.k_cache, layer.v_cache = (torch.zeros(shape, dtype=weight.dtype, device=device)
                                            for _ in "kv")
        model.forward(tokens, positions, meta)
        for layer in layers:
            layer.k_scale.copy_(_scale(layer.k_cache, n, K_RANGE))
            layer.v_scale.copy_(_scale(layer.v_cache, n, V_RANGE))
    finally:
        for layer, (k_cache, v_cache) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k_cache, v_cache
