"""Plain-torch twin of the LoRA kernels: the unmerged low-rank delta of a projection for a
batch whose sequences use different adapters (``reference`` re-exports it beside every other
twin)."""

from __future__ import annotations

import torch


def check_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scaling: torch.Tensor, row_part: torch.Tensor, cu_seqlens: torch.Tensor,
               slots: torch.Tensor) -> None:
    """Raise a ValueError naming the first argument of ``add_lora`` whose shape or dtype does
    not fit the others (both twins call it; values on the device are not read)."""
    tokens, k = x.shape
    adapters, parts = scaling.shape
    rank = b.shape[-1]
    problems = {
        "b": (f"rank capacity {rank} is not a power of two >= 16"
              if rank < 16 or rank & (rank - 1) else None),
        "out": f"{tuple(out.shape)} is not [{tokens}, N]" if out.shape[0] != tokens else None,
        "a": (f"{tuple(a.shape)} is not [{adapters}, {parts * rank}, {k}]"
              if a.shape != (adapters, parts * rank, k) else None),
        "scaling": f"is {scaling.dtype}, not float32" if scaling.dtype != torch.float32 else None,
        "row_part": (f"{tuple(row_part.shape)} is not [{out.shape[1]}]"
                     if row_part.shape != out.shape[1:] else None),
        "cu_seqlens": (f"{tuple(cu_seqlens.shape)} is not [{slots.numel() + 1}]"
                       if cu_seqlens.shape != (slots.numel() + 1,) else None),
        "a, b": (f"{a.dtype} and {b.dtype} are not x's dtype {x.dtype}"
                 if a.dtype != x.dtype or b.dtype != x.dtype else None),
    }
    if b.shape != (adapters, out.shape[1], rank):
        problems["b"] = problems["b"] or f"{tuple(b.shape)} is not [{adapters}, {out.shape[1]}, R]"
    for name, problem in problems.items():
        if problem:
            raise ValueError(f"add_lora: {name} {problem}")


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, row_part: torch.Tensor, cu_seqlens: torch.Tensor,
             slots: torch.Tensor, max_rows: int) -> torch.Tensor:
    """Add each sequence's adapter delta to the projection's output ``out [T, N]`` (in place;
    returned) for its input ``x [T, K]``.

    Sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (int32 ``[B+1]``) and uses
    adapter ``slots[i]`` (int32 ``[B]``; -1: none, its rows are left alone, as are rows past
    ``cu_seqlens[-1]``). The projection has ``P`` parts (``scaling [S, P]`` float32: 1 for
    o/down, 3 for a merged q/k/v, 2 for gate/up); ``a [S, P*R, K]`` holds part ``p``'s lora_A
    in rows ``p*R:(p+1)*R``, ``b [S, N, R]`` output row ``n``'s lora_B row, ``row_part [N]``
    (int32) the part of each output row (each in ``0..P-1``), both zero-padded in ``R`` where
    an adapter's rank is lower. For a row ``t`` of slot ``s`` and output ``n`` of part ``p``:

        out[t, n] += scaling[s, p] * sum_r h[t, p*R + r] * b[s, n, r],  h[t] = a[s] @ x[t]

    Rounding points: ``h`` and its product with ``b`` are float32 (products of the 16-bit
    values, float32 sums), times ``scaling`` in float32; the delta is rounded to ``out``'s
    dtype, then added in it (peft's order: the LoRA branch in the model's dtype, added to the
    base output). ``max_rows`` (the longest run: the Triton twin's grid) is not needed here.
    """
    check_lora(out, x, a, b, scaling, row_part, cu_seqlens, slots)
    num_parts, rank = scaling.shape[1], b.shape[2]
    columns = [torch.nonzero(row_part == p).squeeze(1) for p in range(num_parts)]
    starts = cu_seqlens.tolist()
    by_slot: dict[int, list[torch.Tensor]] = {}
    for seq, slot in enumerate(slots.tolist()):
        if slot >= 0 and starts[seq + 1] > starts[seq]:
            by_slot.setdefault(slot, []).append(
                torch.arange(starts[seq], starts[seq + 1], device=x.device))
    for slot, runs in by_slot.items():  # few adapters a batch: one product each
        rows = torch.cat(runs)
        h = x[rows].float() @ a[slot].float().T
        delta = torch.zeros(rows.numel(), out.shape[1], dtype=torch.float32, device=x.device)
        for p, cols in enumerate(columns):
            part = h[:, p * rank:(p + 1) * rank] @ b[slot, cols].float().T
            delta[:, cols] = part * scaling[slot, p]
        out[rows] += delta.to(out.dtype)
    return out
