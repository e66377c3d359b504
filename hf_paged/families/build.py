"""A checkpoint -> its family's paged model on a device, one tensor-parallel rank's shard."""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import transformers
from transformers import PretrainedConfig

from hf_paged import families
from hf_paged.families.vision_language import FP8_RELEASE_REFUSAL, language_model_keys
from hf_paged.modeling.kv_scale_keys import PATTERN as KV_SCALE_KEYS
from hf_paged.modeling.kv_scale_keys import read_kv_scales
from hf_paged.modeling.loader import (
    Checkpoint,
    ExpectedKeys,
    load_weights,
    match_keys,
    ties_embeddings,
)
from hf_paged.modeling.paged_model import PagedModel
from hf_paged.modeling.tp import SINGLE, TensorParallel
from hf_paged.quantization import Fp8Scheme, fp8_model


def build_model(
    config: PretrainedConfig,
    checkpoint: str,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    tp: TensorParallel = SINGLE,
    quantization: Fp8Scheme | None = None,
) -> PagedModel:
    """transformers' skeleton of the family on meta -> the keys it expects (in the
    checkpoint's layout; a vision-language release's language-model keys renamed as
    transformers renames them, ``families.vision_language``) -> the family's swap (FP8
    weights where ``quantization`` makes transformers' modules FP8) -> check the checkpoint's
    keys -> allocate on ``device`` -> load this rank's weights, and the KV-cache scales where
    the checkpoint ships them (``modeling.kv_scale_keys``). ``config`` has passed
    ``families.check_model``."""
    family = families.family_for(config)
    converted, skip, kept = set(), [], set()
    with torch.device("meta"):
        hf = getattr(transformers, family.ARCHITECTURE)(config)
        expected = ExpectedKeys.of(hf)  # transformers' names and full shapes, before the swap
        if quantization is not None:
            converted, skip = fp8_model.converted_modules(hf, quantization)
        family.swap_modules(hf, attention_backend, max_positions, tp)
    # Every rank checks (and fails alike); rank 0 alone logs.
    weights, conversions = language_model_keys(Checkpoint.open(checkpoint), config.model_type,
                                                  expected.ignored, log=tp.rank == 0)
    if conversions and quantization is not None and quantization.pre_quantized:
        # its quantization_config names the release's modules, not the causal LM's
        raise ValueError(f"checkpoint {checkpoint}: {FP8_RELEASE_REFUSAL} (their language "
                         f"model's keys are renamed to {config.model_type}'s)")
    float_shapes = family.checkpoint_keys(expected.shapes, weights.shapes.keys())
    shapes, dtypes = float_shapes, {}
    if quantization is not None:
        shapes, dtypes, kept = fp8_model.checkpoint_keys(shapes, converted, quantization)
    # The KV-cache scales are optional keys, consumed below.
    expected = replace(expected, shapes=shapes, dtypes=dtypes,
                       ignored=re.compile(f"{expected.ignored.pattern}|{KV_SCALE_KEYS.pattern}"))
    kv_scales = read_kv_scales(weights, config.num_hidden_layers, config.num_key_value_heads)
    hf.to(dtype)  # on meta; FP8 weights replace float ones after the cast
    dequantizing = quantization is not None and quantization.dequantize
    scales = (fp8_model.hold_fp8(hf, kept, family.PACKED_MODULES, quantization)
              if quantization is not None and not dequantizing else [])
    # An FP8 checkpoint dequantized as it loads: each FP8 weight read with its scale grid.
    read_with = ({key: fp8_model.scale_key(key)
                  for key in fp8_model.fp8_weights(float_shapes, converted)}
                 if dequantizing else {})
    tied = ties_embeddings(weights, bool(getattr(config, "tie_word_embeddings", False)),
                           log=tp.rank == 0)
    sources = match_keys(weights, expected, tied, log=tp.rank == 0)
    if tied:
        del hf.lm_head.weight
    hf.to_empty(device=device).eval()
    if tied:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb.build_cache(device)
    for module in hf.modules():
        if getattr(module, "block", None) is not None:
            module.init_scale_rows()
    quantized_on_load = quantization is not None and not quantization.pre_quantized
    load_weights(hf, weights, sources, family.weight_target, scales if quantized_on_load else (),
                 read_with, lambda key, weight, inv: fp8_model.dequantized(
                     key, weight, inv, quantization.block, dtype))
    for layer, (k_scale, v_scale) in kv_scales.items():
        hf.model.layers[layer].self_attn.set_kv_scales(k_scale.to(device), v_scale.to(device))
    if quantized_on_load:  # now an FP8 model, saved as one (as in transformers)
        config.quantization_config = fp8_model.saved_config(quantization, skip, converted - kept)
    if dequantizing:  # an unquantized model now, as transformers leaves it
        del config.quantization_config
    if conversions:  # saved back in the checkpoint's layout, as transformers does
        hf._weight_conversions = conversions
    return PagedModel(hf)
