"""Qwen3 checkpoints with real shapes and seeded random weights, for machines without a hub.

The embedding (and LM head) is drawn wide enough that logits are peaked: greedy decoding then
has clear winners, so token-for-token comparisons with transformers are meaningful. Each
checkpoint comes with a small byte-level BPE tokenizer, trained when it is written on a text
kept in the package, with a Qwen-style chat template, so prompts, pipelines and chat work
offline.
"""

from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

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
def random_qwen3(
    config: Qwen3Config, seed: int = 0, logit_scale: float = 4.0, device: str = "cpu"
) -> Qwen3ForCausalLM:
    """A Qwen3 model with seeded weights: std ``1.5 / sqrt(fan_in)`` inside the blocks (they
    visibly transform the residual stream, so outputs are not a bigram table) and embeddings of
    std ``logit_scale / sqrt(hidden_size)``, so that logits spread over about ``logit_scale``.
    The weights are drawn on ``device`` (a GPU draws an 8B model in seconds, the CPU in
    minutes); a seed gives the same weights on the same kind of device only."""
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(config.dtype or torch.float32)
    wide = logit_scale / config.hidden_size**0.5
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        embedding = "embed_tokens" in name or "lm_head" in name
        std = wide if embedding else 1.5 / param.shape[-1] ** 0.5
        param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return model.eval()


# Qwen3's layout: <|endoftext|> (padding), <|im_start|>, <|im_end|> (end of a turn: EOS) are
# consecutive ids from pad_token_id.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TOKENIZER_VOCAB = 1024


def train_tokenizer(config: Qwen3Config) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most 1,024 ids trained on ``data/tokenizer_corpus.txt``,
    its special tokens at the config's ids (Qwen3's layout) and padding on the left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if config.eos_token_id != config.pad_token_id + 2:
        raise ValueError("the tokenizer puts <|endoftext|>, <|im_start|>, <|im_end|> at "
                         "pad_token_id, +1, +2: eos_token_id must be pad_token_id + 2")
    text = resources.files("hf_paged").joinpath("data/tokenizer_corpus.txt").read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(config.vocab_size, _TOKENIZER_VOCAB), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    # Training numbers the special tokens 0, 1, 2; move them to the model's ids.
    spec = json.loads(tokenizer.to_str())
    ids = {token: config.pad_token_id + i for i, token in enumerate(SPECIAL_TOKENS)}
    for added in spec["added_tokens"]:
        added["id"] = ids[added["content"]]
    spec["model"]["vocab"].update(ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", padding_side="left", chat_template=CHAT_TEMPLATE,
        model_max_length=config.max_position_embeddings,
    )


def make_checkpoint(
    shape: str, out_dir: str, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu"
) -> str:
    """Write a random Qwen3 checkpoint of a named shape (``SHAPES``), with its generation
    config and tokenizer, to ``out_dir``; the weights are drawn on ``device``."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    config = Qwen3Config(**SHAPES[shape], dtype=dtype)
    model = random_qwen3(config, seed, device=device)
    model.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    train_tokenizer(config).save_pretrained(out_dir)
    return out_dir
