"""Vision-language releases of a served text model (Qwen3.5's and Qwen3.5-MoE's
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` checkpoints),
served as transformers' ``AutoModelForCausalLM`` serves them: as their text model.

- The config is the release's ``text_config`` (``causal_lm_config``: the swap transformers'
  ``AutoModelForCausalLM`` makes when the causal LM it maps the release's config to is built
  from that text config, the release's ``quantization_config`` carried over).
- The checkpoint's language-model keys (``model.language_model.*``) are renamed by
  transformers' own prefix changes of the text model type (``language_model_keys``), and a
  model loaded from them saves them so again (the conversions transformers records as used,
  reverted by its ``save_pretrained``), as transformers' does.
- The tensors transformers' causal LM skips without a word (the vision tower,
  ``model.visual.*``; the multi-token prediction layers, ``mtp.*``) are counted in one log
  line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection

from transformers import PretrainedConfig

from hf_paged.families import REGISTRY
from hf_paged.modeling.loader import Checkpoint

logger = logging.getLogger(__name__)

# Key prefixes of the releases' parts the causal LM does not hold -> what they are.
SKIPPED_PARTS = {"model.visual.": "the vision tower", "mtp.": "the multi-token prediction layers"}
# generate() / model-call arguments of the releases' image and video inputs (and the token
# types their processor returns beside them): transformers' causal LM refuses them in generate
# and drops them in its forward without a word.
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                 "mm_token_type_ids")


# A release's quantization_config names the release's modules, not the causal LM's.
FP8_RELEASE_REFUSAL = ("FP8 checkpoints of vision-language releases are not supported by "
                       "hf_paged")


def causal_lm_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config transformers' ``AutoModelForCausalLM`` builds ``config``'s checkpoint from:
    a vision-language release's text config (carrying the release's quantization_config) when
    the causal LM transformers maps the release to takes that text config and hf_paged serves
    its model type; ``config`` itself otherwise."""
    text_class = getattr(config, "sub_configs", {}).get("text_config")
    if text_class is None:
        return config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return config
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = config.get_text_config()
    if getattr(causal_lm, "config_class", None) is not text_class or (
            text.model_type not in REGISTRY):
        return config
    if getattr(config, "quantization_config", None) is not None:
        text.quantization_config = config.quantization_config
    return text


def used_conversions(model_type: str, keys: Collection[str]) -> list:
    """transformers' weight conversions of ``model_type``'s checkpoints that some of ``keys``
    match: what transformers' ``from_pretrained`` records as used, and reverts on saving."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return [t for t in get_checkpoint_conversion_mapping(model_type) or ()
            if any(t.rename_source_key(k)[1] is not None for k in keys)]


def _renamed(changes: list, key: str) -> str:
    for change in changes:
        key = change.rename_source_key(key)[0]
    return key


def language_model_keys(checkpoint: Checkpoint, model_type: str, ignored: re.Pattern,
                        log: bool = True) -> tuple[Checkpoint, list]:
    """``checkpoint`` with its keys in the causal LM's layout (transformers' prefix changes of
    ``model_type``; the families read both expert layouts themselves) and, when it had to be
    renamed, the conversions transformers would record loading it (``used_conversions``), else
    none. Logs how many tensors of each skipped part (keys the causal LM's ``ignored`` pattern
    drops) it holds."""
    counts = {prefix: sum(k.startswith(prefix) and bool(ignored.search(k))
                          for k in checkpoint.shapes) for prefix in SKIPPED_PARTS}
    if log and any(counts.values()):
        parts = " and ".join(f"{SKIPPED_PARTS[p]} ({n} tensors, {p}*)"
                             for p, n in counts.items() if n)
        logger.warning("checkpoint %s: %s not loaded: the causal LM holds the text model alone, "
                       "as transformers' does", checkpoint.path, parts)
    from transformers.core_model_loading import PrefixChange

    used = used_conversions(model_type, checkpoint.shapes.keys())
    changes = [t for t in used if isinstance(t, PrefixChange)]
    if not changes:
        return checkpoint, []
    back = [change.reverse_transform() for change in reversed(changes)]
    return checkpoint.renamed(lambda k: _renamed(changes, k), lambda k: _renamed(back, k)), used


def refuse_vision_inputs(arguments: Collection[str], call: str) -> None:
    """Raise ValueError naming the first image or video input among ``arguments`` of
    ``call`` (``generate()``, ``forward()``)."""
    given = [name for name in VISION_INPUTS if name in arguments]
    if given:
        raise ValueError(f"{call} got {given[0]}: image and video inputs are not supported; "
                         "hf_paged serves text models (of a vision-language checkpoint, its "
                         "text model, as transformers' AutoModelForCausalLM does)")
