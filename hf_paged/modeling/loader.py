"""safetensors checkpoint -> (sharded) parameters, one tensor at a time; a tensor-parallel
rank reads only its own slices of the file."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

# Checkpoint projection -> (merged module, shard id) in the swapped model.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder: a single file or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def target_of(name: str) -> tuple[str, object]:
    """Parameter name in the swapped model and shard id for a checkpoint tensor name."""
    for ckpt, (merged, shard_id) in PACKED_MODULES.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{merged}."), shard_id
    return name, None


@torch.no_grad()
def load_weights(model: nn.Module, path: str, tied_embeddings: bool) -> None:
    """Copy every checkpoint tensor into its (shard of a) parameter; error on any mismatch."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    filled: set[tuple[str, object]] = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if tied_embeddings and name == "lm_head.weight":
                    continue  # the embedding matrix serves as the LM head
                target, shard_id = target_of(name)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of Qwen3")
                # Loaders live on the modules: parameters are re-created when materialised.
                module = model.get_submodule(target.rpartition(".")[0])
                loader = getattr(module, "weight_loader", None)
                tensor = f.get_slice(name)
                if loader is None:  # replicated on every rank
                    param.copy_(tensor[()])
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
                filled.add((target, shard_id))
    missing = sorted(n for n in params if not any(t == n for t, _ in filled))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for: {', '.join(missing[:8])}")
