"""The named shapes of random checkpoints (``hf-paged make-checkpoint --shape``): real
models' config keywords, and tiny ones for tests. Plain data, so the command line lists them
without importing torch."""

_QWEN3 = dict(
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    head_dim=128, num_key_value_heads=8, bos_token_id=151643, eos_token_id=151645,
    pad_token_id=151643,
)
_TINY_HYBRID = dict(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# A vision tower of one block for the vision-language releases' tiny shapes (never run: it
# fills the release's layout).
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                    out_hidden_size=64, num_position_embeddings=16)


def _release(model_type: str, text: dict) -> dict:
    """A vision-language release's keywords around a text model's (its ``text_config``)."""
    return dict(model_type=model_type, text_config=text, vision_config=_TINY_VISION,
                tie_word_embeddings=text["tie_word_embeddings"])


# Each shape's config keywords; ``model_type`` (default "qwen3") picks the config class; a
# vision-language release's text model is its ``text_config``.
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
    "32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                num_attention_heads=64, tie_word_embeddings=False),
    # Qwen3-MoE: every layer sparse, top-k weights renormalised, as the released checkpoints.
    "tiny-moe": dict(_QWEN3, model_type="qwen3_moe", vocab_size=1024, hidden_size=64,
                     intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=2048, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "30b-a3b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                    norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, tie_word_embeddings=False),
    "235b-a22b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=4096,
                      intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=94,
                      num_attention_heads=64, num_key_value_heads=4, tie_word_embeddings=False),
    # Hybrids: Gated DeltaNet layers with a gated attention layer every fourth (transformers'
    # default layer_types), partial RoPE (a quarter of head_dim), untied as the releases.
    "tiny-next": dict(_TINY_HYBRID, model_type="qwen3_next", intermediate_size=128,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "tiny-qwen3.5": dict(_TINY_HYBRID, model_type="qwen3_5_text", intermediate_size=128),
    "tiny-qwen3.5-moe": dict(_TINY_HYBRID, model_type="qwen3_5_moe_text",
                             moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             num_experts=8, num_experts_per_tok=2),
}
# Qwen3.5's text models at their releases' widths (Qwen/Qwen3.5-9B, Qwen/Qwen3.5-35B-A3B):
# every size below is transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig default, which
# those classes take from these releases (hidden 4096 / 2048, 32 / 40 layers, 16 attention
# heads of 256 with a quarter rotary, 4 / 2 KV heads, 16 key and 32 value Gated DeltaNet heads
# of 128, kernel 4, vocabulary 248,320; the MoE 256 experts of 512, 8 a token, a shared expert
# of 512), spelled out so that a later default cannot move them. Not taken from the releases'
# own config.json (no hub here): the special-token ids (Qwen's layout, <|endoftext|> then
# <|im_start|>, <|im_end|>, at the released vocabulary's 248,044), the RoPE base (the default)
# and the context length (32,768) are assumptions; none changes a step's bytes.
_QWEN3_5 = dict(
    vocab_size=248320, num_attention_heads=16, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=248044, eos_token_id=248046, pad_token_id=248044,
)
SHAPES["qwen3.5-9b"] = dict(_QWEN3_5, model_type="qwen3_5_text", hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=32, num_key_value_heads=4)
SHAPES["qwen3.5-35b-a3b"] = dict(
    _QWEN3_5, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
    num_key_value_heads=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=256, num_experts_per_tok=8)
# Qwen3.5's releases as the hub ships them (Qwen3_5ForConditionalGeneration, ...): the text
# model under model.language_model, beside a vision tower.
SHAPES["tiny-qwen3.5-vl"] = _release("qwen3_5", SHAPES["tiny-qwen3.5"])
SHAPES["tiny-qwen3.5-moe-vl"] = _release("qwen3_5_moe", SHAPES["tiny-qwen3.5-moe"])
