"""A fine-grained FP8 model's side of loading: which of transformers' modules are FP8 (its own
rules), the checkpoint keys and dtypes that follows from, and the swapped modules that hold
their weights in float8_e4m3fn.

transformers decides which modules an FP8 checkpoint converts (``replace_with_fp8_linear``:
every ``nn.Linear`` and every ``.experts`` block, but for ``modules_to_not_convert``, or, when
the config names none, the tied and output embeddings and the last module); that decision is
taken on transformers' own skeleton, by its own code. A swapped module that merges several
checkpoint tensors (q/k/v, gate/up) is FP8 when all its parts are, and refused when only some
are: one matrix cannot be both.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import (
    FP8Experts,
    FP8Linear,
    replace_with_fp8_linear,
)
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from hf_paged.kernels.block_scales import BlockScales, dequantize, grid_rows
from hf_paged.modeling.linear import cdiv
from hf_paged.quantization.fp8 import Fp8Scheme

WEIGHT_DTYPE = ("F8_E4M3",)
SCALE_DTYPES = ("F32", "BF16", "F16")  # read as float32, exactly
_FUSED_GATE_UP = "gate_up_proj"  # transformers 5's fused experts: gate rows, then up rows


def converted_modules(skeleton: nn.Module, scheme: Fp8Scheme) -> tuple[set[str], list[str]]:
    """The modules of transformers' model (on meta; replaced in place) that its FP8 loading
    converts, by transformers' own quantizer and ``replace_with_fp8_linear``, and its
    ``modules_to_not_convert`` as the quantizer resolved them."""
    # Which modules an FP8 checkpoint holds in FP8 (transformers converts none when it
    # dequantizes, but the checkpoint holds the same FP8 tensors).
    settings = {k: v for k, v in scheme.config.items()
                if k not in ("quant_method", "fmt", "ignored_layers", "dequantize")}
    config = FineGrainedFP8Config(**{**settings, "modules_to_not_convert": (
        None if scheme.modules_to_not_convert is None else list(scheme.modules_to_not_convert))})
    quantizer = FineGrainedFP8HfQuantizer(config, pre_quantized=scheme.pre_quantized)
    # Renames a released checkpoint's skip-list to the model's module names (transformers
    # 5.2x; earlier 5.x releases name them as they are).
    normalize = getattr(quantizer, "_normalize_modules_to_not_convert", None)
    if normalize is not None:
        normalize(skeleton)
    skip = quantizer.get_modules_to_not_convert(
        skeleton, config.modules_to_not_convert, skeleton._keep_in_fp32_modules)
    replace_with_fp8_linear(skeleton, modules_to_not_convert=skip, quantization_config=config,
                            pre_quantized=scheme.pre_quantized)
    return {name for name, module in skeleton.named_modules()
            if isinstance(module, (FP8Linear, FP8Experts))}, skip


def saved_config(scheme: Fp8Scheme, skip: list[str], left_float: set[str]) -> dict:
    """The quantization_config of a model quantized on load, as it saves: the passed one,
    with the modules whose blocks were not whole (left float) added to the resolved
    ``modules_to_not_convert``, so that the saved checkpoint loads as what it holds."""
    if not left_float:
        return dict(scheme.config)
    return {**scheme.config, "modules_to_not_convert": sorted({*skip, *left_float})}


def owner(key: str, converted: Collection[str]) -> str | None:
    """The converted module a checkpoint key belongs to (an expert's matrix belongs to its
    layer's experts), or None."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:end]) in converted:
            return ".".join(parts[:end])
    return None


def is_weight(key: str, shape: tuple[int, ...]) -> bool:
    """Whether a converted module's checkpoint tensor is a weight FP8 applies to (not a
    bias)."""
    return len(shape) >= 2 and not key.endswith(".bias")


def scale_key(key: str) -> str:
    """transformers' name of a weight's scale grid (``Fp8Quantize``'s rule)."""
    return key.removesuffix(".weight") + ".weight_scale_inv" if key.endswith(".weight") else (
        key + "_scale_inv")


def grid_shape(key: str, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight: ``[..., ceil(N / bn), ceil(K / bk)]``; fused experts'
    gate/up weight ``[E, 2I, H]`` stacks gate's grid and up's."""
    (bn, bk), (n, k) = block, shape[-2:]
    rows = 2 * cdiv(n // 2, bn) if key.endswith(_FUSED_GATE_UP) else cdiv(n, bn)
    return (*shape[:-2], rows, cdiv(k, bk))


def fp8_weights(shapes: dict[str, tuple[int, ...]], converted: Collection[str]) -> list[str]:
    """The keys, among an unquantized model's checkpoint keys ``shapes``, of the weights that
    the converted modules hold in FP8."""
    return [k for k, shape in shapes.items() if is_weight(k, shape) and owner(k, converted)]


def checkpoint_keys(shapes: dict[str, tuple[int, ...]], converted: set[str],
                    scheme: Fp8Scheme
                    ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]], set[str]]:
    """The keys (with shapes), the dtypes they must have and the converted modules, for the
    checkpoint keys ``shapes`` of an unquantized model: a pre-quantized checkpoint holds each
    converted weight in FP8 with its grid; quantized on load, the float weights whose
    every block is whole are quantized (transformers' ``Fp8Quantize`` leaves the others as
    they are), the module's other weights with them or it stays float."""
    weights = {k: owner(k, converted) for k in fp8_weights(shapes, converted)}
    if not scheme.pre_quantized:
        bn, bk = scheme.block
        partial = {module for k, module in weights.items()
                   if shapes[k][-1] % bk or (shapes[k][-2] // (
                       2 if k.endswith(_FUSED_GATE_UP) else 1)) % bn}
        return dict(shapes), {}, converted - partial
    out, dtypes = dict(shapes), {}
    for key in weights:
        dtypes[key] = WEIGHT_DTYPE
        out[scale_key(key)] = grid_shape(key, shapes[key], scheme.block)
        dtypes[scale_key(key)] = SCALE_DTYPES
    return out, dtypes, converted


def dequantized(key: str, weight: torch.Tensor, inv: torch.Tensor, block: tuple[int, int],
                dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint weight ``key``'s FP8 values times their grid ``inv``'s scales, in float32,
    rounded once to ``dtype``, as transformers' ``Fp8Dequantize`` loads them (a fused
    gate/up weight's grid stacks gate's and up's)."""
    n = weight.shape[-2]
    parts = [n // 2, n // 2] if key.endswith(_FUSED_GATE_UP) else [n]
    scales = BlockScales(inv.float(), grid_rows(parts, block[0], inv.device), block[1])
    return dequantize(weight, scales, dtype)


def hold_fp8(model: nn.Module, converted: set[str], packed_modules: dict[str, tuple[str, object]],
             scheme: Fp8Scheme) -> list[str]:
    """Swapped modules (on meta, in the model dtype) whose checkpoint tensors are all FP8
    take FP8 weights (``hold_fp8``); returns their scale parameters' names. Raises ValueError
    naming a merged module of FP8 and float parts, or a converted module hf_paged keeps in
    the model dtype (the LM head)."""
    parts_of: dict[str, list[str]] = {}
    for name, (merged, _) in packed_modules.items():
        parts_of.setdefault(merged, []).append(name)
    covered, scales = set(), []
    for name, module in model.named_modules():
        if not hasattr(module, "hold_fp8"):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part in parts_of.get(leaf, [leaf])]
        fp8 = [part in converted for part in parts]
        if all(fp8):
            module.hold_fp8(scheme.block)
            covered.update(parts)
            scales += [f"{name}.{p}" for p, _ in module.named_parameters() if "scale" in p]
        elif any(fp8):
            raise ValueError(
                f"{name}: the quantization_config makes "
                f"{', '.join(p for p, f in zip(parts, fp8) if f)} FP8 but not "
                f"{', '.join(p for p, f in zip(parts, fp8) if not f)}; hf_paged runs them as "
                "one matrix, which is either FP8 or not (list them all in "
                "modules_to_not_convert, or none" + ("" if scheme.pre_quantized else
                "; quantized on load, a weight whose blocks are not whole stays float") + ")")
    kept = sorted(converted - covered)
    if kept:
        raise ValueError(f"the quantization_config makes {', '.join(kept)} FP8, which hf_paged "
                         "keeps in the model dtype (add it to modules_to_not_convert)")
    return scales
