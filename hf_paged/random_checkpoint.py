"""Qwen3 checkpoints with real shapes and seeded random weights, for machines without a hub.

The embedding (and LM head) is drawn wide enough that logits are peaked: greedy decoding then
has clear winners, so token-for-token comparisons with transformers are meaningful.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

_QWEN3 = dict(
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    head_dim=128, num_key_value_heads=8, bos_token_id=151643, eos_token_id=151645,
    pad_token_id=151643,
)
SHAPES: dict[str, dict] = {
    "tiny": dict(_QWEN3, vocab_size=1024, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=2048, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, tie_word_embeddings=True),
    "1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, tie_word_embeddings=True),
    "8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, tie_word_embeddings=False),
}


@torch.no_grad()
def random_qwen3(config: Qwen3Config, seed: int = 0, logit_scale: float = 4.0) -> Qwen3ForCausalLM:
    """A Qwen3 model with seeded weights: std ``1.5 / sqrt(fan_in)`` inside the blocks (they
    visibly transform the residual stream, so outputs are not a bigram table) and embeddings of
    std ``logit_scale / sqrt(hidden_size)``, so that logits spread over about ``logit_scale``."""
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(config.dtype or torch.float32)
    wide = logit_scale / config.hidden_size**0.5
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        embedding = "embed_tokens" in name or "lm_head" in name
        std = wide if embedding else 1.5 / param.shape[-1] ** 0.5
        param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.eval()


def make_checkpoint(shape: str, out_dir: str, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write a random Qwen3 checkpoint of a named shape (``SHAPES``) to ``out_dir``."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    config = Qwen3Config(**SHAPES[shape], dtype=dtype)
    model = random_qwen3(config, seed)
    model.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    return out_dir
