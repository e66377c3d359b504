"""What peft looks for on the drop-in model: a module under each checkpoint projection's name.

peft injects an adapter by wrapping the modules whose names its ``target_modules`` match
(``q_proj``, ``gate_proj``, ...). Attention and o/down keep transformers' names; q/k/v and
gate/up live merged (``qkv_proj``, ``gate_up_proj``). ``install`` puts a ``ProjectionPart``
under each merged part's own name: an ``nn.Linear`` with no parameters of its own whose
``weight`` is a view of its rows of the merged weight. peft wraps it, reads its shape and
device, and merges into it (``merge_and_unload`` adds into the merged weight through the
view); the step never calls it (the engine adds the adapters itself, ``peft_sync``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import families
from hf_paged.modeling.linear import _ParallelLinear, part_index


class ProjectionPart(nn.Linear):
    """Rows ``[start, start + out_features)`` of a merged projection, as one projection."""

    def __init__(self, merged: _ParallelLinear, part: int):
        nn.Module.__init__(self)
        rows = merged.parts
        self.start, self.part = sum(rows[:part]), part
        self.in_features, self.out_features = merged.weight.shape[1], rows[part]
        # Unregistered: state_dict, parameters() and to() see the merged module only.
        self.__dict__["merged"] = merged
        self.__dict__["weight"] = self.view()
        self.__dict__["bias"] = None if merged.bias is None else merged.bias[
            self.start:self.start + self.out_features]

    def view(self) -> nn.Parameter:
        """The merged weight's rows of this part (sharing its memory)."""
        rows = self.merged.weight[self.start:self.start + self.out_features]
        return nn.Parameter(rows, requires_grad=False)

    def shares_memory(self) -> bool:
        """Whether ``weight`` still views the merged weight: peft's ``safe_merge`` replaces a
        weight's ``.data`` by a merged copy, which ``write_back`` then copies in."""
        return self.weight.data_ptr() == self.view().data_ptr()

    def write_back(self) -> None:
        """Copy a replaced ``weight`` into the merged weight's rows and view them again."""
        self.merged.weight.data[self.start:self.start + self.out_features].copy_(self.weight)
        self.__dict__["weight"] = self.view()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> None:
    """A ``ProjectionPart`` under each merged part's checkpoint name (``q_proj`` beside
    ``qkv_proj``, ...), in every module that holds a merged projection."""
    packed = getattr(families.family_for(model.config), "PACKED_MODULES", {})  # none: no parts
    for module in list(model.modules()):
        for name, (merged_name, shard) in packed.items():
            merged = module._modules.get(merged_name)
            if isinstance(merged, _ParallelLinear) and name not in module._modules:
                module.add_module(name, ProjectionPart(merged, part_index(merged, shard)))


def parts(model: nn.Module) -> list[ProjectionPart]:
    """Every ``ProjectionPart`` of ``model``, also those peft has wrapped."""
    return [m for m in model.modules() if isinstance(m, ProjectionPart)]
