"""A hybrid model's state pools: per linear-attention (Gated DeltaNet) layer, one tensor
``[num_slots, *shape]`` per state its family names (``state_shapes``: the convolution's last
inputs and the recurrent state), attached to the layer's ``linear_attn`` module under that
name, as the KV cache attaches ``k_cache`` / ``v_cache`` to ``self_attn``. A sequence's state
lives in the same slot of every pool (``engine.state_slots`` hands the slots out); a step's
slot copies (forks, prefix-cache snapshots and restores) run here before its forward.

A model is hybrid when its family module defines ``linear_layer_ids``. It has ``max_num_seqs``
slots, one per sequence that may run (forks included: see ``engine.state_slots``), then
``num_state_snapshots`` for the prefix cache (``engine.state_snapshots``). The pools are
allocated once, before the KV cache is sized from what memory is left, and never move: the
CUDA graphs read them by address.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from hf_paged.device_copy import to_device
from hf_paged.families import family_for
from hf_paged.modeling.paged_model import PagedModel

# state name -> (one slot's shape on one rank, dtype; None: the model's)
StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


class StateCache:
    """The state pools of ``modules`` (each a layer's ``linear_attn``)."""

    def __init__(self, modules: list[nn.Module], shapes: StateShapes, dtype: torch.dtype,
                 device: torch.device):
        self.modules = modules
        self.shapes = {name: (tuple(shape), dtype if state_dtype is None else state_dtype)
                       for name, (shape, state_dtype) in shapes.items()}
        self.device = device
        self.num_slots = 0

    def slot_bytes(self) -> int:
        """Bytes of one slot over every layer and state."""
        per_layer = sum(math.prod(shape) * dtype.itemsize
                        for shape, dtype in self.shapes.values())
        return per_layer * len(self.modules)

    def allocate(self, num_slots: int) -> None:
        """Give every layer zeroed pools of ``num_slots`` slots."""
        for module in self.modules:
            for name, (shape, dtype) in self.shapes.items():
                setattr(module, name, torch.zeros((num_slots, *shape), dtype=dtype,
                                                  device=self.device))
        self.num_slots = num_slots

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Fork copies ``(source, destination)``, with the effect of making them in order: a
        launch per pool reads all its sources before it writes, so a copy reading a slot that
        an earlier one writes starts a new launch."""
        for wave in _waves(copies):
            src, dst = (to_device(list(x), self.device) for x in zip(*wave))
            for module in self.modules:
                for name in self.shapes:
                    pool = getattr(module, name)
                    pool.index_copy_(0, dst, pool.index_select(0, src))

    @contextlib.contextmanager
    def scratch(self, num_slots: int):
        """Point every layer at one zeroed set of pools of ``num_slots`` slots while the
        model call runs (``modeling.full_forward``), then back at the engine's, which it
        leaves alone. The layers share the set: each runs over every row, from zeros, before
        the next starts."""
        saved = [{name: getattr(module, name) for name in self.shapes} for module in self.modules]
        pools = {name: torch.zeros((num_slots, *shape), dtype=dtype, device=self.device)
                 for name, (shape, dtype) in self.shapes.items()}
        try:
            for module in self.modules:
                for name, pool in pools.items():
                    setattr(module, name, pool)
            yield
        finally:
            for module, own in zip(self.modules, saved):
                for name, pool in own.items():
                    setattr(module, name, pool)

    def close(self) -> None:
        for module in self.modules:
            for name in self.shapes:
                setattr(module, name, torch.empty(0))
        self.num_slots = 0


def _waves(copies: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``copies`` cut where a copy reads or rewrites a slot that an earlier copy of the same
    wave writes."""
    waves: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in copies:
        if not waves or src in written or dst in written:
            waves.append([])
            written = set()
        waves[-1].append((src, dst))
        written.add(dst)
    return waves


def state_cache_for(model: PagedModel, tp_size: int, dtype: torch.dtype,
                    device: torch.device) -> StateCache | None:
    """The state pools of a hybrid model's linear-attention layers (not allocated yet), from
    its family's ``linear_layer_ids`` and ``state_shapes``; None for a model without them."""
    family = family_for(model.config)
    if not hasattr(family, "linear_layer_ids"):
        return None
    modules = model.state_modules
    expected = len(family.linear_layer_ids(model.config))
    if len(modules) != expected:
        raise ValueError(f"{model.config.model_type}: the config names {expected} "
                         f"linear-attention layers but the model has {len(modules)}")
    return StateCache(modules, family.state_shapes(model.config, tp_size), dtype, device)
