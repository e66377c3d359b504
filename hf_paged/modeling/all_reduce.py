"""The tensor-parallel all-reduce of CUDA ranks through PyTorch's symmetric memory.

On two H200s NCCL's all-reduce of a decode step's activations (2 MiB at batch 256 of an 8B
model, twice a layer) took about 31 us, 28% of the step (here: 19 us): NCCL picks its low-
latency ring protocol there, which moves flags with the data. Here every rank's staging
buffer is mapped into the others' address space once, at start-up; a reduction copies its
tensor into the buffer and one kernel sums the ranks' copies straight out of their memory
(one-shot: every rank reads everything, and the kernel does the copy too; two-shot: each
rank sums a slice, then gathers the others' sums, fewer bytes per rank beyond two ranks).
Every rank sums in rank order, so all ranks get the same result, as NCCL's does. The kernels
are captured in the CUDA graphs like NCCL's.

Tensors that do not fit the buffer (long prefill steps) take NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ONE_SHOT_MAX_BYTES = 256 * 1024  # beyond two ranks, larger messages go two-shot
# torch keeps a process's symmetric-memory set-up of a group (its store) by the group's name
# for the life of the process, and a later group can take a freed group's name ("0" again
# once the default group is destroyed): a second engine in this process would rendezvous
# through the first one's store and wait forever for peers that are not there.
_GROUP_NAMES_SET_UP: set[str] = set()


class SymmetricAllReduce:
    """Sum-all-reduce of tensors of up to ``numel`` elements of ``dtype`` over ``group``;
    constructing it is collective (every rank of the group maps the others' buffers)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 numel: int):
        from torch.distributed import _symmetric_memory as symm_mem

        _GROUP_NAMES_SET_UP.add(group.group_name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group.group_name)
        self.group_name = group.group_name
        self.always_one_shot = group.size() == 2

    @staticmethod
    def set_up_before(group: dist.ProcessGroup) -> bool:
        """Whether this process has set up symmetric memory for a group of this name."""
        return group.group_name in _GROUP_NAMES_SET_UP

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of every rank's ``x``, or None if ``x`` does not fit (``x`` is left as it
        was, or overwritten with the sum)."""
        n, nbytes = x.numel(), x.numel() * x.element_size()
        if x.dtype != self.buffer.dtype or n > self.buffer.numel() or nbytes % 16 \
                or not x.is_contiguous():
            return None
        staged, flat = self.buffer[:n], x.view(-1)
        if self.always_one_shot or nbytes <= _ONE_SHOT_MAX_BYTES:
            # The kernel stages x itself: no copy kernel before it (at batch 1 that copy's
            # launch cost as much as the reduction's data).
            out = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum",
                                                            self.group_name, out.view(-1))
            return out
        staged.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x
