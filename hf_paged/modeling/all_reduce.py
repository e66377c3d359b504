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

Which kernel serves a message is measured, not assumed: at start-up every rank times one-shot,
two-shot and NCCL, replayed from CUDA graphs, on messages from one token to the buffer's size
(``tune``), and each size takes the fastest that summed right (one that does not is never
used). On two NVLinked H200s one-shot took 19 us for 2 MiB where NCCL took 31 us; over PCIe,
or for large messages, NCCL may win. Tensors that do not fit the buffer (long prefill steps)
take NCCL.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from hf_paged.cuda_graphs import graph_micros

logger = logging.getLogger(__name__)
ALGORITHMS = ("one_shot", "two_shot", "nccl")
_TUNE_TOKENS = (1, 16, 128, 512, 2048)  # message sizes timed, in tokens' hidden states
# torch keeps a process's symmetric-memory set-up of a group (its store) by the group's name
# for the life of the process, and a later group can take a freed group's name ("0" again
# once the default group is destroyed): a second engine in this process would rendezvous
# through the first one's store and wait forever for peers that are not there.
_GROUP_NAMES_SET_UP: set[str] = set()


def fastest(micros: dict[int, dict[str, float]]) -> list[tuple[int, str]]:
    """``(up to this many bytes, algorithm)``, ascending, from the microseconds each algorithm
    took per message size in bytes (an algorithm that summed wrong is missing; NCCL where
    none is left)."""
    return [(size, min(times, key=times.get) if times else "nccl")
            for size, times in sorted(micros.items())]


class SymmetricAllReduce:
    """Sum-all-reduce of tensors of up to ``numel`` elements of ``dtype`` over ``group``;
    constructing it is collective (every rank of the group maps the others' buffers)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 numel: int):
        from torch.distributed import _symmetric_memory as symm_mem

        _GROUP_NAMES_SET_UP.add(group.group_name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group.group_name)
        self.group = group
        self.choices: list[tuple[int, str]] = []  # by ``tune``; empty: the untuned rule

    @staticmethod
    def set_up_before(group: dist.ProcessGroup) -> bool:
        """Whether this process has set up symmetric memory for a group of this name."""
        return group.group_name in _GROUP_NAMES_SET_UP

    def algorithm(self, nbytes: int) -> str:
        """The algorithm for a message of ``nbytes``: that of the smallest size timed that
        holds it (one-shot before ``tune``, which only the set-up's test sum meets)."""
        for limit, name in self.choices:
            if nbytes <= limit:
                return name
        return self.choices[-1][1] if self.choices else "one_shot"

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of every rank's ``x``, or None to leave ``x`` to NCCL (it does not fit, or
        NCCL is fastest for its size); ``x`` itself may be overwritten with the sum."""
        nbytes = x.numel() * x.element_size()
        if x.dtype != self.buffer.dtype or x.numel() > self.buffer.numel() or nbytes % 16 \
                or not x.is_contiguous():
            return None
        return self.reduce(x, self.algorithm(nbytes))

    def reduce(self, x: torch.Tensor, algorithm: str) -> torch.Tensor | None:
        if algorithm == "nccl":
            return None
        staged, flat = self.buffer[: x.numel()], x.view(-1)
        if algorithm == "one_shot":
            # The kernel stages x itself: no copy kernel before it (at batch 1 that copy's
            # launch cost as much as the reduction's data).
            out = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum",
                                                            self.group.group_name, out.view(-1))
            return out
        staged.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group.group_name, flat)
        return x

    def tune(self, hidden: int, reps: int = 5) -> dict[int, dict[str, float]]:
        """Time every algorithm on messages of ``_TUNE_TOKENS`` tokens' hidden states (as
        many as the buffer holds; ``reps`` reductions in a CUDA graph, the slowest rank's
        time), keep the fastest per size, and return the microseconds. Collective."""
        rank, device = self.group.rank(), self.buffer.device
        sizes = [t * hidden for t in _TUNE_TOKENS if t * hidden <= self.buffer.numel()]
        micros = {}
        for numel in sizes:
            x = torch.empty(numel, dtype=self.buffer.dtype, device=device)
            measured = []
            for name in ALGORITHMS:
                try:  # fails alike on every rank, if at all: the same call on the same size
                    measured.append((self._sums_right(x, name, rank), self._time(x, name, reps)))
                except Exception:  # e.g. an algorithm this torch lacks
                    measured.append((False, math.inf))
            right = torch.tensor([int(ok) for ok, _ in measured], device=device)
            times = torch.tensor([t for _, t in measured], device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(right, op=dist.ReduceOp.MIN, group=self.group)
            micros[numel * x.element_size()] = {
                name: t for name, t, ok in zip(ALGORITHMS, times.tolist(), right.tolist()) if ok}
        torch.cuda.empty_cache()  # the graphs' memory, before the KV cache is sized
        self.choices = fastest(micros)
        logger.info("rank %d of %d: all-reduce by message size (bytes): %s", rank,
                    self.group.size(), self.choices)
        return micros

    def _run(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        if algorithm == "nccl":
            dist.all_reduce(x, group=self.group)
            return x
        return self.reduce(x, algorithm)

    def _sums_right(self, x: torch.Tensor, algorithm: str, rank: int) -> bool:
        x.fill_(rank + 1)
        expected = self.group.size() * (self.group.size() + 1) // 2
        return bool((self._run(x, algorithm) == expected).all())

    def _time(self, x: torch.Tensor, algorithm: str, reps: int) -> float:
        """Microseconds per reduction, ``reps`` of them replayed from one CUDA graph."""
        x.zero_()

        def step():
            for _ in range(reps):
                self._run(x, algorithm)

        return graph_micros(step, replays=1) / reps
