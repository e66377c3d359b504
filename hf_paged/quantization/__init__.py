"""Quantized checkpoints: a ``quantization_config`` (a checkpoint's config.json's, or one passed
to ``from_pretrained``) resolved into the plain scheme a rank builds from, or refused by name
before anything loads.

One module a served format, named by its ``quant_method`` in ``SERVED``; every other method
(awq, gptq, bitsandbytes, compressed-tensors, torchao, ...) is refused: hf_paged would
otherwise copy packed integers or scaled floats into float weights and answer wrongly without a
word.
"""

from __future__ import annotations

import importlib

from transformers import PretrainedConfig

from hf_paged.quantization.fp8 import Fp8Scheme

# quant_method -> the module that serves it (its ``resolve(own, passed)``).
SERVED: dict[str, str] = {"fp8": "hf_paged.quantization.fp8"}
SERVED_DESCRIPTION = ("fine-grained FP8 (quant_method 'fp8': float8_e4m3fn weights, "
                      "block-wise weight_scale_inv, dynamic activations)")


def as_dict(quantization_config: object) -> dict | None:
    """A ``quantization_config`` as config.json holds it: a dict, or a transformers
    ``QuantizationConfigMixin``'s ``to_dict()``."""
    if quantization_config is None or isinstance(quantization_config, dict):
        return quantization_config
    to_dict = getattr(quantization_config, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"quantization_config must be a dict or a transformers quantization "
                         f"config, got {type(quantization_config).__name__}")
    return to_dict()


def _method(config: dict) -> str:
    method = config.get("quant_method")
    return getattr(method, "value", method)  # transformers' QuantizationMethod enum


def _served(method: str, where: str) -> str:
    if method not in SERVED:
        raise ValueError(f"{where}: quant_method {method!r} is not served by hf_paged, which "
                         f"serves {SERVED_DESCRIPTION} and unquantized checkpoints")
    return method


def resolve(config: PretrainedConfig, passed: object = None) -> Fp8Scheme | None:
    """The scheme of the checkpoint ``config`` describes, quantized on load by ``passed`` (a
    ``quantization_config`` given to ``from_pretrained``) when the checkpoint is not; None for
    an unquantized model. Raises ValueError naming the ``quant_method`` or setting that is not
    served. As in transformers, a checkpoint's own config wins over a passed one of the same
    method (whose loading attributes apply); of another method, it is an error. A passed
    ``dequantize=True`` for an unquantized checkpoint asks for nothing: None."""
    own = as_dict(getattr(config, "quantization_config", None))
    passed = as_dict(passed)
    if own is None and passed is None:
        return None
    if own is not None and passed is not None and _method(own) != _method(passed):
        raise ValueError(f"quantization_config: the checkpoint is quantized with quant_method "
                         f"{_method(own)!r}, the passed config names {_method(passed)!r}")
    method = (_served(_method(own), "the checkpoint's quantization_config") if own is not None
              else _served(_method(passed), "quantization_config"))
    scheme = importlib.import_module(SERVED[method]).resolve(own, passed)
    return None if scheme.dequantize and not scheme.pre_quantized else scheme


__all__ = ["SERVED", "Fp8Scheme", "as_dict", "resolve"]
