"""Fine-grained FP8 (``quant_method: "fp8"``): float8_e4m3fn weights, each with a float32
``weight_scale_inv`` per ``weight_block_size`` block, activations quantized dynamically, as
Qwen's and DeepSeek's FP8 checkpoints and transformers' ``FineGrainedFP8Config`` describe them.

``resolve`` reads such a config into an ``Fp8Scheme`` (plain data: it travels to the
tensor-parallel ranks) or refuses, by name, what hf_paged does not serve: static activation
scales, per-tensor scales (no ``weight_block_size``), ``ue8m0`` scales, FP4 experts, FP8
embeddings, another ``fmt`` than e4m3. ``dequantize=True`` (transformers' loading attribute)
loads an FP8 checkpoint's weights dequantized into the model dtype, as transformers does: the
model is then an unquantized one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import FineGrainedFP8Config

# The keys of a fine-grained FP8 config (transformers' FineGrainedFP8Config, and ``fmt`` of
# the released checkpoints); anything else is refused rather than ignored, unless it is a
# setting of the installed transformers' FineGrainedFP8Config at its default.
_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "scale_fmt",
         "dequantize", "modules_to_not_convert", "ignored_layers", "modules_to_convert",
         "expert_dtype"}
# Settings at the values hf_paged serves (a missing key takes transformers' default).
# ``weight_block_size`` is required.
_SERVED_VALUES = {"activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "float",
                  "expert_dtype": "fp8"}
# transformers' loading attributes: a passed config's override the checkpoint's.
_LOADING_ATTRIBUTES = ("dequantize", "modules_to_not_convert")


@dataclass(frozen=True)
class Fp8Scheme:
    """A fine-grained FP8 model as a rank builds it."""

    block: tuple[int, int]  # weight_block_size: (output rows, input columns) a scale covers
    # transformers' modules_to_not_convert as given (None: its defaults, resolved on the model)
    modules_to_not_convert: tuple[str, ...] | None
    pre_quantized: bool  # the checkpoint holds FP8 weights; else they are quantized on load
    config: dict  # the quantization_config as config.json keeps it
    # An FP8 checkpoint's weights dequantized into the model dtype as they load (transformers'
    # ``dequantize=True``): the model holds no FP8 weight, and keeps no quantization_config.
    dequantize: bool = False


def check_device(scheme: Fp8Scheme, device: torch.device) -> None:
    """Raise ValueError when the kernels of ``device`` cannot read ``scheme``'s blocks: on
    CUDA a GEMM's K step (at least 16, the tensor cores' depth) stays within one scale column,
    so blocks narrower than 16 columns are served on the CPU path only."""
    if device.type == "cuda" and scheme.block[1] < 16 and not scheme.dequantize:
        raise _refuse("weight_block_size", list(scheme.block), "on CUDA the block's input "
                      "width must be at least 16")


def _refuse(key: str, value: object, why: str) -> ValueError:
    return ValueError(f"quantization_config (quant_method 'fp8'): {key}={value!r} is not served "
                      f"by hf_paged ({why}); it serves fine-grained FP8 with "
                      "weight_block_size [bn, bk], activation_scheme 'dynamic', fmt 'e4m3', "
                      "float scales")


def _checked(config: dict) -> dict:
    defaults = _plain(FineGrainedFP8Config().to_dict())
    unknown = sorted(k for k in set(config) - _KEYS
                     if k not in defaults or _plain({k: config[k]})[k] != defaults[k])
    if unknown:
        raise _refuse(unknown[0], config[unknown[0]], "a setting hf_paged does not know")
    for key, served in _SERVED_VALUES.items():
        value = config.get(key, served)
        if (value.lower() if isinstance(value, str) else value) != served:
            raise _refuse(key, value, f"only {served!r}")
    if config.get("modules_to_convert"):
        raise _refuse("modules_to_convert", config["modules_to_convert"],
                      "FP8 embeddings are not served")
    # Absent, transformers would assume 128x128 blocks: a per-tensor checkpoint's scales would
    # then be read as a grid. Qwen's and DeepSeek's releases always name it.
    block = config.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "per-tensor FP8 is not served; a block size "
                      "is two positive integers")
    # The kernels step along K by whole scale columns, in tiles of a power of two.
    if block[1] & (block[1] - 1):
        raise _refuse("weight_block_size", block, "the block's input width (its second number) "
                      "must be a power of two")
    skip = config.get("modules_to_not_convert", config.get("ignored_layers"))
    if skip is not None and not (isinstance(skip, (list, tuple))
                                 and all(isinstance(s, str) for s in skip)):
        raise _refuse("modules_to_not_convert", skip, "a list of module names")
    return config


def _plain(config: dict) -> dict:
    """``config`` with transformers' enum ``quant_method`` as its string and tuples as lists, as
    json writes it."""
    return {k: getattr(v, "value", list(v) if isinstance(v, tuple) else v)
            for k, v in config.items()}


def resolve(own: dict | None, passed: dict | None) -> Fp8Scheme:
    """The scheme of a checkpoint quantized as ``own`` says (None: not quantized, then it is
    quantized on load as ``passed`` says)."""
    config = _plain(_checked(dict(own if own is not None else passed)))
    if own is not None and passed is not None:
        _checked(passed)
        config.update({k: _plain(passed)[k] for k in _LOADING_ATTRIBUTES if k in passed})
        _checked(config)
    skip = config.get("modules_to_not_convert", config.get("ignored_layers"))
    return Fp8Scheme(
        block=tuple(config["weight_block_size"]),
        modules_to_not_convert=None if skip is None else tuple(skip),
        pre_quantized=own is not None,
        config=config,
        dequantize=bool(config.get("dequantize", False)),
    )


def check_split(what: str, total: int, per_rank: int, tp_size: int, block: int, unit: str,
                module: str) -> None:
    """Raise ValueError, naming the dimension, when a rank's ``per_rank`` of ``total`` rows
    (or columns) cuts ``module``'s FP8 blocks of ``block``: its scales would cover rows of two
    ranks."""
    if per_rank % block and per_rank != total:
        raise ValueError(f"{what} {total} / tensor_parallel_size {tp_size} cuts the "
                         f"{block}-{unit} FP8 blocks of {module} (each rank would hold "
                         f"{per_rank} {unit}s)")
