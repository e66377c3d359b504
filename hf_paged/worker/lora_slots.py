"""The LoRA adapters a worker holds, in slots: where each adapter tensor goes (the family's
merged projections: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), the stacks beside
those projections (``modeling.lora``, made when the first adapter loads, for every projection
an adapter may adapt, so a later adapter never reshapes them), and each step's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from hf_paged.kernels.lora_tiles import LoraTiles
from hf_paged.modeling.linear import _ParallelLinear, part_index
from hf_paged.modeling.lora import LoraBatch, LoraStack
from hf_paged.modeling.paged_model import PagedModel

if TYPE_CHECKING:
    from hf_paged.lora.adapter import LoraAdapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoraSlots:
    """``num_slots`` adapter slots of rank up to ``rank`` on ``model``'s projections;
    ``weight_target`` is the family's (checkpoint tensor -> parameter and part)."""

    def __init__(self, model: PagedModel, num_slots: int, rank: int,
                 weight_target: Callable[[str], tuple[str, object]]):
        self.model, self.num_slots, self.rank = model, num_slots, rank
        self.weight_target = weight_target
        self.batch = LoraBatch()
        self.stacks: list[LoraStack] = []

    @property
    def capacity(self) -> int:
        """The stacks' rank: ``max_lora_rank`` rounded up to a power of two from 16 (the
        kernels' tile of the rank)."""
        return max(16, 1 << (self.rank - 1).bit_length())

    @property
    def nbytes(self) -> int:
        """Device memory the stacks take (0 before the first adapter)."""
        return sum(stack.nbytes for stack in self.stacks)

    def target(self, layer: int, projection: str) -> tuple[_ParallelLinear, int]:
        """The module adapting ``projection`` of layer ``layer`` and the part it is of it; a
        ValueError naming both where the model has no such projection (a MoE layer's
        experts)."""
        block = "self_attn" if projection in ATTENTION else "mlp"
        name, shard = self.weight_target(f"model.layers.{layer}.{block}.{projection}.weight")
        parent, leaf = name.rsplit(".", 2)[:2]
        try:
            block = self.model.hf_model.get_submodule(parent)
        except AttributeError:
            module = None
        else:  # the projection the step calls (``keep_computing``), peft's wrapper aside
            module = getattr(block, "compute", {}).get(leaf, getattr(block, leaf, None))
        if not isinstance(module, _ParallelLinear):
            raise ValueError(f"LoRA on {projection} of layer {layer}: that layer has no such "
                             f"projection (LoRA on MoE experts is not supported)")
        return module, part_index(module, shard)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` (its whole tensors) in ``slot``, each tensor sliced to this rank's
        share as the projection's weight loader slices the base weight (every target checked
        first: a refused adapter leaves the slots as they were)."""
        targets = self.check(adapter)
        if not self.stacks:
            self.allocate()
        self.unload(slot)
        for key, weight in adapter.weights.items():
            module, part = targets[key]
            a, b = module.lora_shard(part, weight.a, weight.b)
            module.lora.load(slot, part, a, b, weight.scaling)

    def check(self, adapter: LoraAdapter) -> dict[tuple[int, str], tuple[_ParallelLinear, int]]:
        """The module and part each of ``adapter``'s tensors goes to; a ValueError naming what
        is refused (a rank above ``max_lora_rank``, a projection the model lacks)."""
        if adapter.max_rank > self.rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.max_rank}, above "
                             f"max_lora_rank={self.rank}")
        return {key: self.target(*key) for key in adapter.weights}

    def unload(self, slot: int) -> None:
        for stack in self.stacks:
            stack.clear(slot)

    @contextlib.contextmanager
    def rows(self, tiles: LoraTiles | None) -> Iterator[None]:
        """The projections add the deltas of ``tiles``' rows (None: none) while in the
        context: a decode graph captures them over its input buffers."""
        self.batch.rows = tiles
        try:
            yield
        finally:
            self.batch.rows = None

    def tiles(self, cu_seqlens: list[int], slots: list[int]) -> LoraTiles | None:
        """The tiles of a step's sequences (rows ``cu_seqlens[i]:cu_seqlens[i+1]``) on
        ``slots``, on the device; None where no sequence is on an adapter."""
        if not self.stacks or all(s < 0 for s in slots):
            return None
        return LoraTiles.build(np.diff(cu_seqlens), slots, self.model.embed_tokens.weight.device)

    def allocate(self) -> None:
        """A stack beside every projection an adapter may adapt, each once (q, k and v share
        ``qkv_proj``'s)."""
        weight = self.model.embed_tokens.weight
        for layer in range(len(self.model.layers)):
            for projection in ATTENTION + MLP:
                try:
                    module, _ = self.target(layer, projection)
                except ValueError:  # a MoE layer's experts
                    continue
                if module.lora is None:
                    module.lora = LoraStack(module.parts, module.weight.shape[1],
                                            self.num_slots, self.capacity, self.batch,
                                            weight.dtype, weight.device)
                    self.stacks.append(module.lora)
