"""Qwen3 and Qwen3-MoE checkpoints with real shapes and seeded random weights, for machines
without a hub.

The embedding (and LM head) is drawn wide enough that logits are peaked: greedy decoding then
has clear winners, so token-for-token comparisons with transformers are meaningful. Each
checkpoint comes with a small byte-level BPE tokenizer, trained when it is written on a text
kept in the package, with a Qwen-style chat template, so prompts, pipelines and chat work
offline. ``quantize="fp8"`` writes the layout of Qwen's fine-grained FP8 releases: every
projection and expert in float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128 block
(transformers' ``Fp8Quantize`` math; a block cut short by a dimension that is not a multiple
of 128 takes the max of its own elements), the LM head and the MoE routers in the model
dtype (``modules_to_not_convert``). A shape of a vision-language release (a config with a
``vision_config``: Qwen3.5's ``Qwen3_5ForConditionalGeneration``) is written in its layout: the
random text model's weights under ``model.language_model``, beside a random vision tower.
"""

from __future__ import annotations

import copy
import json
import os
from importlib import resources

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.initialization import no_init_weights

from hf_paged.checkpoint_shapes import SHAPES
from hf_paged.kernels.block_scales import quantize
from hf_paged.modeling.loader import checkpoint_files
from hf_paged.quantization import fp8, fp8_model

QUANTIZE = ("fp8",)  # make_checkpoint's quantize choices
# Qwen's FP8 releases' quantization_config (modules_to_not_convert added per model).
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}


def shape_config(shape: str, dtype: str = "float32", layers: int | None = None
                 ) -> PretrainedConfig:
    """The config of a named shape (``SHAPES``), with ``layers`` decoder layers instead of the
    shape's own when given (each layer's shape unchanged: a benchmark checkpoint of a large
    model that fits a disk)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    kwargs = dict(SHAPES[shape], dtype=dtype)
    text = kwargs
    if "text_config" in kwargs:  # a vision-language release: its text model's keywords
        text = kwargs["text_config"] = dict(kwargs["text_config"], dtype=dtype)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        text["num_hidden_layers"] = layers
    return AutoConfig.for_model(kwargs.pop("model_type", "qwen3"), **kwargs)


@torch.no_grad()
def random_qwen3(
    config: PretrainedConfig, seed: int = 0, logit_scale: float = 4.0, device: str = "cpu"
) -> PreTrainedModel:
    """A Qwen3 or Qwen3-MoE model (as the config says) with seeded weights: std
    ``1.5 / sqrt(fan_in)`` inside the blocks (they visibly transform the residual stream, so
    outputs are not a bigram table) and embeddings of std ``logit_scale / sqrt(hidden_size)``,
    so that logits spread over about ``logit_scale``.
    The weights are drawn on ``device`` (a GPU draws an 8B model in seconds, the CPU in
    minutes); a seed gives the same weights on the same kind of device only."""
    gen = torch.Generator(device).manual_seed(seed)
    # Held on the CPU (every weight is drawn below, so transformers' own initialisation is
    # skipped): a GPU draws, but holds no model larger than itself (Qwen3-30B-A3B's 48 layers
    # are 61 GB in bf16). Built in its dtype: a float32 copy of a 30B would not fit either.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)
    model.tie_weights()  # skipped with the initialisation
    wide = logit_scale / config.hidden_size**0.5
    hybrid = _hybrid_parameters(model, gen, device)
    for name, param in model.named_parameters():
        if name in hybrid:
            param.copy_(hybrid[name])
            continue
        if "norm" in name:
            param.fill_(1.0)
            continue
        embedding = "embed_tokens" in name or "lm_head" in name
        std = wide if embedding else 1.5 / param.shape[-1] ** 0.5  # experts: [E, out, in]
        param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return model.eval()


# The hybrids' norms -> the value their weight is drawn around: the zero-centred norms store
# an offset from one, the gated norms of the Gated DeltaNet output the scale itself.
_HYBRID_NORMS = {f"{family}{kind}": centre for family in ("Qwen3Next", "Qwen3_5", "Qwen3_5Moe")
                 for kind, centre in (("RMSNorm", 0.0), ("RMSNormGated", 1.0))}


def _hybrid_parameters(model: PreTrainedModel, gen: torch.Generator, device: str
                       ) -> dict[str, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 parameters that are not projections: the zero-centred norms'
    offsets (std 0.1, so that a norm that ignored them would be caught), the gated norms near
    one, and each Gated DeltaNet head's decay (``A_log``: ``A`` in [0.05, 1], the state fading
    over a few tokens to a few hundred rather than at once) and ``dt_bias`` (std 0.5). Empty
    for other models."""
    out = {}
    for prefix, module in model.named_modules():
        centre = _HYBRID_NORMS.get(type(module).__name__)
        if centre is not None:
            out[f"{prefix}.weight"] = centre + 0.1 * torch.randn(
                module.weight.shape, generator=gen, device=device)
        if hasattr(module, "A_log"):
            heads = module.A_log.shape
            out[f"{prefix}.A_log"] = (0.05 + 0.95 * torch.rand(heads, generator=gen,
                                                               device=device)).log()
            out[f"{prefix}.dt_bias"] = 0.5 * torch.randn(heads, generator=gen, device=device)
    return out


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


def train_tokenizer(config: PretrainedConfig) -> PreTrainedTokenizerFast:
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
    shape: str, out_dir: str, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu",
    layers: int | None = None, quantize: str | None = None,
) -> str:
    """Write a random checkpoint of a named shape (``SHAPES``; ``layers`` overrides its layer
    count), with its generation config and tokenizer, to ``out_dir``; the weights are drawn on
    ``device``; ``quantize="fp8"``: in the fine-grained FP8 layout."""
    config = shape_config(shape, dtype, layers)
    model = random_qwen3(config.get_text_config(), seed, device=device)
    if hasattr(config, "vision_config"):
        model = vision_language_release(model, config, seed)
    return save_checkpoint(model, out_dir, quantize, device=device)


@torch.no_grad()
def vision_language_release(text: PreTrainedModel, config: PretrainedConfig, seed: int = 0
                            ) -> PreTrainedModel:
    """The vision-language model of ``config`` (``Qwen3_5ForConditionalGeneration``, ...)
    holding ``text``'s weights (a model of ``config``'s text config) and a vision tower of
    seeded weights."""
    torch.manual_seed(seed)  # transformers' own initialisation draws the vision tower
    model = AutoModelForImageTextToText.from_config(config, dtype=text.dtype)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model.eval()


def save_checkpoint(model: PreTrainedModel, out_dir: str, quantize: str | None = None,
                    block: tuple[int, int] = (128, 128), device: str = "cpu") -> str:
    """Write ``model`` (safetensors) with a generation config of its special tokens and a
    tokenizer (``train_tokenizer``) to ``out_dir``; ``quantize="fp8"``: in the fine-grained
    FP8 layout of ``block``, quantized on ``device``."""
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if quantize and hasattr(model.config, "vision_config"):
        raise ValueError(f"quantize={quantize!r}: a vision-language release is written in "
                         "float only")
    config = model.config.get_text_config()  # a vision-language release's: its text model's
    model.save_pretrained(out_dir)
    if quantize == "fp8":
        quantize_fp8(out_dir, config, block, device)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    train_tokenizer(config).save_pretrained(out_dir)
    return out_dir


def fp8_config(config: PretrainedConfig, block: tuple[int, int] = (128, 128)) -> dict:
    """The quantization_config of a Qwen FP8 release of ``config``'s model: the LM head, the
    MoE routers (``mlp.gate`` of every sparse layer) and shared-expert gates not converted."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routers = [name for name, module in model.named_modules()
               if (name.endswith(".mlp.gate") and hasattr(module, "top_k"))
               or name.endswith(".mlp.shared_expert_gate")]
    return dict(FP8_CONFIG, weight_block_size=list(block),
                modules_to_not_convert=["lm_head", *routers])


@torch.no_grad()
def quantize_fp8(out_dir: str, config: PretrainedConfig, block: tuple[int, int] = (128, 128),
                 device: str = "cpu", source: str | None = None) -> None:
    """Rewrite the float checkpoint in ``out_dir`` (``config``'s model) in the fine-grained FP8
    layout: each weight of a module transformers converts (``fp8_model.converted_modules``)
    as float8_e4m3fn with its ``weight_scale_inv`` grid (computed on ``device``), the rest as
    they were; config.json gets the ``quantization_config``. ``source``: a folder whose
    weight files are read instead of ``out_dir``'s (written to ``out_dir`` under the same
    names, one at a time: no float copy of the weights is made)."""
    quantization = fp8_config(config, block)
    scheme = fp8.resolve(quantization, None)
    with torch.device("meta"):
        converted, _ = fp8_model.converted_modules(AutoModelForCausalLM.from_config(config),
                                                   scheme)
    moved = {}
    for file in checkpoint_files(source or out_dir):
        with safe_open(file, framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        for key in list(tensors):
            if fp8_model.is_weight(key, tensors[key].shape) and fp8_model.owner(key, converted):
                values, inv = quantize(tensors[key].to(device), block)
                tensors[key], tensors[fp8_model.scale_key(key)] = values.cpu(), inv.cpu()
                moved[fp8_model.scale_key(key)] = os.path.basename(file)
        save_file(tensors, os.path.join(out_dir, os.path.basename(file)), metadata=metadata)
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            spec = json.load(f)
        spec["weight_map"].update(moved)
        with open(index, "w") as f:
            json.dump(spec, f, indent=2)
    config = copy.deepcopy(config)
    config.quantization_config = quantization
    config.save_pretrained(out_dir)
