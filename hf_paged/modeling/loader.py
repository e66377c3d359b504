"""safetensors checkpoint -> (sharded) parameters, one tensor at a time; a tensor-parallel
rank reads only its own slices of the file.

Every key is accounted for, from the file headers, before anything is allocated or copied,
as transformers' ``from_pretrained`` reports them: keys the model expects that the checkpoint
lacks (one part of a merged projection included), keys whose full shape differs, and keys the
model does not use. Missing and mis-shaped keys are errors, since hf_paged never runs on
uninitialised memory; unused keys are logged and loading goes on, as in transformers, unless
they are quantization tensors (scales, zero points, packed weights): a model that does not
use those would run on the raw quantized values. So is a tensor of a dtype its parameter
cannot take as it is (an FP8 tensor into a float parameter: its scale would be missing).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Checkpoint projection -> (merged module, shard id) in the swapped model: a family's fused
# weight groups (Qwen3's: q/k/v -> qkv_proj, gate/up -> gate_up_proj).
PackedModules = dict[str, tuple[str, object]]
LM_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# The causal LMs' base_model_prefix: keys saved from a bare inner model (Qwen3Model) lack it.
PREFIX = "model."
# Besides the class's own list, transformers drops these unexpected keys without a word (old
# checkpoints stored the RoPE buffers).
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq",)
LISTED = 10  # names shown per kind of problem; the rest are counted
# Unused tensors that belong to a quantized layer (scales, zero points, packed integers,
# bitsandbytes' statistics): the last part of their name. The KV cache's k_scale / v_scale are
# not among them (a cache in the model dtype does without them).
QUANTIZATION_TENSOR = re.compile(
    r"\.(?![kv]_scale$)[^.]*(scale|zero|qweight|g_idx|absmax|quant_map|quant_state|SCB"
    r"|weight_format)[^.]*$")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0")  # safetensors' names


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder: a single file or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        absent = [n for n in names if not os.path.exists(os.path.join(path, n))]
        if absent:
            raise FileNotFoundError(f"{index} names files that are not there: {', '.join(absent)}")
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


@dataclass
class Checkpoint:
    """A checkpoint folder's tensors, from the file headers only: the file holding each and
    its full shape, by the name the model knows it by (``stored``: the name in the file of a
    tensor ``renamed`` gave another; ``stored_as``: the name a tensor the file lacks would
    have there)."""

    path: str
    files: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # safetensors' names: "BF16", ...
    stored: dict[str, str] = field(default_factory=dict)
    stored_as: Callable[[str], str] | None = None

    @classmethod
    def open(cls, path: str) -> Checkpoint:
        checkpoint = cls(path)
        for file in checkpoint_files(path):
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        checkpoint.files[name] = file
                        tensor = f.get_slice(name)
                        checkpoint.shapes[name] = tuple(tensor.get_shape())
                        checkpoint.dtypes[name] = tensor.get_dtype()
            except SafetensorError as error:  # a header that does not cover the file
                raise OSError(f"{file} is truncated or corrupt, not a readable safetensors "
                              f"file ({error})") from error
        return checkpoint

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, read on the CPU."""
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(self.key(name))

    def key(self, name: str) -> str:
        """The name in the file of the tensor ``name`` (or that it would have there): what
        errors and logs show."""
        if name in self.stored:
            return self.stored[name]
        return self.stored_as(name) if self.stored_as and name not in self.shapes else name

    def renamed(self, rename: Callable[[str], str], back: Callable[[str], str]) -> Checkpoint:
        """The same tensors, each by the name ``rename`` gives its name; ``back`` names a
        model key in the file's layout. Two tensors of one new name are an error naming both."""
        out = Checkpoint(self.path, stored_as=back)
        for name in self.shapes:
            new = rename(name)
            if new in out.shapes:
                raise ValueError(f"checkpoint {self.path} holds both {out.key(new)} and "
                                 f"{self.key(name)}, which are the same tensor {new}")
            out.files[new], out.shapes[new] = self.files[name], self.shapes[name]
            out.dtypes[new] = self.dtypes[name]
            if new != self.key(name):
                out.stored[new] = self.key(name)
        return out


@dataclass(frozen=True)
class ExpectedKeys:
    """The keys transformers' model loads from a checkpoint, with their full (unsharded)
    shapes, and the unexpected keys it ignores silently; ``architecture`` names the model in
    errors. ``dtypes``: the dtypes (safetensors' names) a key may have where the model asks
    for some; any other key may have any but an FP8 one."""

    shapes: dict[str, tuple[int, ...]]
    ignored: re.Pattern
    architecture: str
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, skeleton: nn.Module) -> ExpectedKeys:
        """From transformers' own model (on meta, before any module is swapped)."""
        patterns = [*(getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or ()),
                    *ALWAYS_IGNORED]
        return cls({k: tuple(v.shape) for k, v in skeleton.state_dict().items()},
                   re.compile("|".join(f"({p})" for p in patterns)), type(skeleton).__name__)


def ties_embeddings(checkpoint: Checkpoint, tie_word_embeddings: bool, log: bool = True) -> bool:
    """Whether the LM head is the embedding matrix. As in transformers: as the config says,
    unless the checkpoint holds both matrices with different values (then they stay apart)."""
    if not tie_word_embeddings or not {LM_HEAD, EMBEDDING} <= checkpoint.shapes.keys():
        return tie_word_embeddings
    head, embedding = checkpoint.tensor(LM_HEAD), checkpoint.tensor(EMBEDDING)
    if head.shape == embedding.shape and torch.equal(head, embedding.to(head.dtype)):
        return True
    if log:
        logger.warning("%s: tie_word_embeddings is set, but the checkpoint holds %s and %s with "
                       "different values, so they are not tied (as in transformers)",
                       checkpoint.path, LM_HEAD, EMBEDDING)
    return False


def _natural(key: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def _listed(kind: str, lines: list[str]) -> list[str]:
    more = [f"    ... and {len(lines) - LISTED} more"] if len(lines) > LISTED else []
    return [f"  {kind} ({len(lines)}):", *(f"    {s}" for s in lines[:LISTED]), *more]


@dataclass
class KeyReport:
    """What of a checkpoint does not fit the model, by checkpoint key."""

    missing: list[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # key, found, expected
    unexpected: list[str]
    wrong_dtype: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)

    @property
    def quantization_tensors(self) -> list[str]:
        return [k for k in self.unexpected if QUANTIZATION_TENSOR.search(k)]

    def error(self, path: str, architecture: str) -> str | None:
        """The message of the loading error, or None when every expected key is there."""
        if not (self.missing or self.mismatched or self.wrong_dtype
                or self.quantization_tensors):
            return None
        lines = [f"checkpoint {path} does not fit {architecture} as its config.json "
                 "describes it; nothing was loaded"]
        if self.missing:
            lines += _listed("missing", self.missing)
        if self.mismatched:
            lines += _listed("wrong shape", [  # whole tensors: a rank's slice would mislead
                f"{k}: checkpoint {list(found)}, model {list(shape)}"
                for k, found, shape in self.mismatched])
        if self.wrong_dtype:
            lines += _listed("wrong dtype", [
                f"{k}: checkpoint {found}, model {' or '.join(allowed) if allowed else 'not FP8'}"
                for k, found, allowed in self.wrong_dtype])
        if self.quantization_tensors:
            lines += _listed("quantization tensors of layers the model holds unquantized "
                             "(its quantization_config does not describe them)",
                             self.quantization_tensors)
        others = [k for k in self.unexpected if not QUANTIZATION_TENSOR.search(k)]
        if others:
            lines += _listed("unexpected", others)
        return "\n".join(lines)


def _dtype_fits(found: str | None, allowed: tuple[str, ...] | None) -> bool:
    if found is None:  # a checkpoint built by hand, without dtypes
        return True
    return found in allowed if allowed else found not in FP8_DTYPES


def match_keys(
    checkpoint: Checkpoint, expected: ExpectedKeys, tied: bool, log: bool = True
) -> dict[str, str]:
    """The checkpoint key that fills each expected key. Raises one ValueError naming every
    missing and mis-shaped key (and the unused ones); logs the unused keys otherwise."""
    shapes = dict(expected.shapes)
    if tied:
        del shapes[LM_HEAD]  # the embedding matrix serves as the LM head
    sources = {k: k for k in shapes if k in checkpoint.shapes}
    for name in checkpoint.shapes:  # a bare inner model's keys: transformers adds the prefix
        if PREFIX + name in shapes:
            sources.setdefault(PREFIX + name, name)
    if tied and EMBEDDING not in sources and LM_HEAD in checkpoint.shapes:
        sources[EMBEDDING] = LM_HEAD  # transformers ties either way round
    # Tied, a checkpoint's LM head is used too: it equals the embedding (ties_embeddings saw to
    # that) or it fills it.
    used = set(sources.values()) | ({LM_HEAD} if tied else set())
    report = KeyReport(
        missing=sorted((checkpoint.key(k) for k in shapes if k not in sources), key=_natural),
        mismatched=sorted(((checkpoint.key(src), checkpoint.shapes[src], shapes[k])
                           for k, src in sources.items() if checkpoint.shapes[src] != shapes[k]),
                          key=lambda m: _natural(m[0])),
        unexpected=sorted((checkpoint.key(n) for n in checkpoint.shapes
                           if n not in used and not expected.ignored.search(n)), key=_natural),
        wrong_dtype=sorted(
            ((checkpoint.key(src), checkpoint.dtypes[src], expected.dtypes.get(k, ()))
             for k, src in sources.items() if not _dtype_fits(checkpoint.dtypes.get(src),
                                                               expected.dtypes.get(k))),
            key=lambda m: _natural(m[0])),
    )
    error = report.error(checkpoint.path, expected.architecture)
    if error:
        raise ValueError(error)
    if report.unexpected and log:
        logger.warning("\n".join([
            f"checkpoint {checkpoint.path}: {expected.architecture} does not use these tensors, "
            "which are ignored (fine for a checkpoint saved from another task or architecture; "
            "not if it should be exactly this model)", *_listed("unexpected", report.unexpected)]))
    return sources


def target_of(name: str, packed_modules: PackedModules) -> tuple[str, object]:
    """Parameter name in the swapped model and shard id for a checkpoint tensor name."""
    for ckpt, (merged, shard_id) in packed_modules.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{merged}."), shard_id
    return name, None


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint: Checkpoint, sources: dict[str, str],
                 weight_target: Callable[[str], tuple[str, object]],
                 filled_alongside: Collection[str] = (),
                 read_with: dict[str, str] | None = None,
                 combine: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 ) -> None:
    """Copy each checkpoint tensor (``match_keys``' choice) into its (shard of a) parameter,
    which ``weight_target`` names with the shard id the parameter's loader takes (the part
    of a merged parameter). ``filled_alongside``: parameters no key names, which loaders fill
    with others (the scales of weights quantized as they load). ``read_with``: keys loaded as
    ``combine(key, tensor, companion)`` with a companion key's whole tensor, which fills no
    parameter of its own (an FP8 weight dequantized with its scales as it loads)."""
    params = dict(model.named_parameters())
    read_with = read_with or {}
    companions = set(read_with.values())
    targets = {key: weight_target(key) for key in sources if key not in companions}
    # A guard against a swapped module that transformers' keys do not describe: every
    # parameter must be filled, and by keys that name it.
    named = {target for target, _ in targets.values()} | set(filled_alongside)
    unfilled, unknown = sorted(params.keys() - named), sorted(named - params.keys())
    if unfilled or unknown:
        raise RuntimeError(f"hf_paged's modules and transformers' keys disagree: unfilled "
                           f"{unfilled}, unknown {unknown}")
    device = next(iter(params.values())).device
    by_file: dict[str, list[str]] = {}
    for key in targets:
        by_file.setdefault(checkpoint.files[sources[key]], []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in keys:
                target, shard_id = targets[key]
                # Loaders live on the modules: parameters are re-created when materialised.
                module = model.get_submodule(target.rpartition(".")[0])
                loader = getattr(module, "weight_loader", None)
                tensor = f.get_slice(checkpoint.key(sources[key]))
                if key in read_with:
                    tensor = combine(key, tensor[()], _whole(checkpoint, sources[read_with[key]],
                                                             device))
                if loader is None:  # replicated on every rank
                    params[target].copy_(tensor[()])
                elif shard_id is None:
                    loader(params[target], tensor)
                else:
                    loader(params[target], tensor, shard_id)


def _whole(checkpoint: Checkpoint, source: str, device: torch.device) -> torch.Tensor:
    """Checkpoint key ``source``'s whole tensor on ``device``."""
    with safe_open(checkpoint.files[source], framework="pt", device=str(device)) as f:
        return f.get_tensor(checkpoint.key(source))
