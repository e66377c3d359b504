"""Shared fixtures: tiny random Qwen3 checkpoints (built once per session) and their
transformers twins, the oracle every parity test compares against; and one tiny checkpoint
with a tokenizer, for the tests that drive hf_paged through transformers and its clients."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from hf_paged.random_checkpoint import (
    SHAPES,
    make_checkpoint,
    quantize_fp8,
    random_qwen3,
    vision_language_release,
)

# Float32 results against stock transformers': the paged kernels sum in another order, so they
# differ by rounding that grows with the value. Comparisons take an absolute tolerance for values
# near zero (logits, per-token log-probabilities) and this relative one, 16 float32 steps of the
# value's size, for sums over many tokens (one step of a log-likelihood of 1,744 is 1.2e-4).
FLOAT32_RTOL = 16 * torch.finfo(torch.float32).eps

# Tiny shapes: grouped-query heads with tied embeddings, multi-head attention with an untied
# LM head, a wider-head GQA model, and a single KV head (replicated under tensor parallelism);
# vocabularies small enough for fast CPU runs.
TINY_CONFIGS = {
    "gqa_tied": dict(SHAPES["tiny"]),
    "mha_untied": dict(SHAPES["tiny"], num_attention_heads=4, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "gqa4_untied": dict(SHAPES["tiny"], hidden_size=128, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                        tie_word_embeddings=False),
    "one_kv_head": dict(SHAPES["tiny"], num_attention_heads=4, num_key_value_heads=1),
}

# Tiny Qwen3-MoE shapes: top-k weights renormalised or not, experts not a power of two, dense
# layers among the sparse ones (mlp_only_layers, decoder_sparse_step 2), tied and untied.
MOE_CONFIGS = {
    "e8_k2_tied": dict(SHAPES["tiny-moe"]),
    "e6_k3_raw_dense0": dict(SHAPES["tiny-moe"], num_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=False, mlp_only_layers=[0], num_hidden_layers=3,
                             tie_word_embeddings=False),
    "e4_k1_step2": dict(SHAPES["tiny-moe"], num_experts=4, num_experts_per_tok=1,
                        decoder_sparse_step=2, num_hidden_layers=4, tie_word_embeddings=False),
    "e16_k4_wide": dict(SHAPES["tiny-moe"], num_experts=16, num_experts_per_tok=4,
                        hidden_size=128, moe_intermediate_size=48, num_attention_heads=8,
                        head_dim=32, num_key_value_heads=4),
}

# Fine-grained FP8 checkpoints (128x128 blocks, as Qwen's releases): every dimension within one
# block, several whole blocks, dimensions cut short (hidden 200, intermediate 300, experts'
# 160: blocks of the definition that stock transformers dequantizes wrongly on a CPU), tied and
# untied, dense and MoE (a dense layer among the sparse ones).
FP8_CONFIGS = {
    "one_block_tied": dict(SHAPES["tiny"]),
    "blocks_untied": dict(SHAPES["tiny"], hidden_size=256, intermediate_size=384,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          tie_word_embeddings=False),
    "cut_200_300": dict(SHAPES["tiny"], hidden_size=200, intermediate_size=300,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "moe_one_block_tied": dict(SHAPES["tiny-moe"]),
    "moe_blocks_dense0": dict(SHAPES["tiny-moe"], hidden_size=256, intermediate_size=256,
                              moe_intermediate_size=128, head_dim=64, mlp_only_layers=[0],
                              tie_word_embeddings=False),
    "moe_cut_160": dict(SHAPES["tiny-moe"], hidden_size=200, moe_intermediate_size=160,
                        num_experts=4, head_dim=64),
}
FP8_CUT = ("cut_200_300", "moe_cut_160")

# Tiny hybrid shapes (Gated DeltaNet and gated attention layers): transformers' default pattern
# (three linear layers, then attention), attention first and last, a dense layer among sparse
# ones, key heads each read by one or by two value heads, tied and untied embeddings.
HYBRID_CONFIGS = {
    "next_dense1": dict(SHAPES["tiny-next"], mlp_only_layers=[1]),
    "next_tied_attention_first": dict(
        SHAPES["tiny-next"], num_hidden_layers=5, decoder_sparse_step=2,
        layer_types=["full_attention", "linear_attention", "linear_attention",
                     "full_attention", "linear_attention"], tie_word_embeddings=True),
    "qwen3.5_tied": dict(SHAPES["tiny-qwen3.5"], num_hidden_layers=3, tie_word_embeddings=True,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3.5_one_value_head_a_key": dict(SHAPES["tiny-qwen3.5"], linear_num_value_heads=2),
    "qwen3.5_moe": dict(SHAPES["tiny-qwen3.5-moe"]),
}

# The vision-language releases' layout (Qwen3_5ForConditionalGeneration, ...: the text model
# under model.language_model beside a vision tower) of a dense hybrid with an untied LM head
# (its RoPE parameters the releases' kind: multimodal sections, interleaved) and a sparse one
# with tied embeddings (the release holds no lm_head.weight).
VISION_LANGUAGE_CONFIGS = {
    "qwen3.5_vl": dict(SHAPES["tiny-qwen3.5-vl"], text_config=dict(
        SHAPES["tiny-qwen3.5"], rope_parameters=dict(
            rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
            mrope_section=[1, 1, 0], mrope_interleaved=True))),
    "qwen3.5_moe_vl_tied": dict(
        SHAPES["tiny-qwen3.5-moe-vl"], tie_word_embeddings=True,
        text_config=dict(SHAPES["tiny-qwen3.5-moe"], tie_word_embeddings=True)),
}

# Engine options small enough for a fast CPU cache; every model built from
# ``tiny_checkpoint`` loads with these.
SMALL = dict(max_model_len=128, num_kv_blocks=64, block_size=8)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a float32 random checkpoint."""
    paths = {}
    for name, shape in TINY_CONFIGS.items():
        path = str(tmp_path_factory.mktemp(name))
        random_qwen3(Qwen3Config(**shape, dtype="float32"), seed=0).save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a float32 random Qwen3-MoE checkpoint, in the hub's layout (one
    matrix per expert and projection, as transformers saves it)."""
    paths = {}
    for name, shape in MOE_CONFIGS.items():
        path = str(tmp_path_factory.mktemp(f"moe_{name}"))
        config = transformers.AutoConfig.for_model(**shape, dtype="float32")
        random_qwen3(config, seed=0).save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def hybrid_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a float32 random hybrid checkpoint (``HYBRID_CONFIGS``)."""
    return {name: float32_checkpoint(tmp_path_factory.mktemp(name), shape)[0]
            for name, shape in HYBRID_CONFIGS.items()}


@pytest.fixture(scope="session")
def vision_language_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a float32 random vision-language release
    (``VISION_LANGUAGE_CONFIGS``)."""
    return {name: float32_checkpoint(tmp_path_factory.mktemp(name), shape)[0]
            for name, shape in VISION_LANGUAGE_CONFIGS.items()}


def float32_checkpoint(folder, shape: dict, seed: int = 0) -> tuple[str, PretrainedConfig]:
    """A random float32 checkpoint of ``shape`` (a Qwen3 one unless it names its
    ``model_type``; a vision-language release's layout when it has a ``text_config``) written
    to ``folder``; the folder and its config."""
    config = transformers.AutoConfig.for_model(**{"model_type": "qwen3", **shape},
                                               dtype="float32")
    text = config.get_text_config()
    text.dtype = torch.float32
    model = random_qwen3(text, seed=seed)
    if text is not config:
        model = vision_language_release(model, config, seed)
    model.save_pretrained(folder)
    return str(folder), config


@pytest.fixture(scope="session")
def fp8_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a random checkpoint in the fine-grained FP8 layout (float32 weights
    quantized by ``hf-paged make-checkpoint --quantize fp8``'s code)."""
    paths = {}
    for name, shape in FP8_CONFIGS.items():
        paths[name], config = float32_checkpoint(tmp_path_factory.mktemp(f"fp8_{name}"), shape)
        quantize_fp8(paths[name], config)
    return paths


@pytest.fixture(scope="session")
def moe_models(moe_checkpoints) -> dict[str, transformers.Qwen3MoeForCausalLM]:
    return {name: transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
            .eval() for name, path in moe_checkpoints.items()}


@pytest.fixture(scope="session")
def hf_models(checkpoints) -> dict[str, Qwen3ForCausalLM]:
    return {
        name: Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A tiny random Qwen3 checkpoint with its tokenizer, as ``hf-paged make-checkpoint``
    writes it."""
    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny_tok")), dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="session")
def stock_model(tiny_checkpoint):
    """``tiny_checkpoint`` under stock transformers."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).eval()


def left_padded(lengths: list[int], vocab: int, pad: int = 0, seed: int = 0):
    """A left-padded batch of random prompts (ids avoid the special ids 0..2)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, width - n :] = 1
    return ids, mask


def transformers_allowed_set(model, prompt: torch.Tensor, kwargs: dict) -> set[int]:
    """The tokens transformers' own processors and warpers (for generate ``kwargs``) leave
    drawable at the next step of ``prompt`` (one row)."""
    with torch.no_grad():
        logits = model(prompt).logits[:, -1].float()
    config, _ = model._prepare_generation_config(None, **kwargs)
    model._prepare_special_tokens(config, False, device="cpu", batch_size=1)
    warp = model._get_logits_processor(config, prompt.shape[1], logits_processor=[])
    return set(torch.isfinite(warp(prompt, logits.clone()))[0].nonzero()[:, 0].tolist())
