"""Plain-torch twin of the LoRA kernels: the unmerged low-rank delta of a projection for a
batch whose sequences use different adapters (``reference.add_lora`` adds it, normalising the
input and gating the output around it as asked, beside every other twin)."""

from __future__ import annotations

import torch

from hf_paged.kernels.lora_tiles import LoraTiles


def check_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scaling: torch.Tensor, row_part: torch.Tensor, tiles: LoraTiles,
               norm: tuple[torch.Tensor, float] | None, gated: bool) -> None:
    """Raise a ValueError naming the first argument of ``add_lora`` whose shape or dtype does
    not fit the others (both twins call it; values on the device are not read)."""
    tokens, k = x.shape
    adapters, parts = scaling.shape
    rank = b.shape[-1]
    order, tile_data, block_m = tiles
    problems = {
        "b": (f"rank capacity {rank} is not a power of two >= 16"
              if rank < 16 or rank & (rank - 1) else None),
        "out": f"{tuple(out.shape)} is not [{tokens}, N]" if out.shape[0] != tokens else None,
        "a": (f"{tuple(a.shape)} is not [{adapters}, {parts * rank}, {k}]"
              if a.shape != (adapters, parts * rank, k) else None),
        "scaling": f"is {scaling.dtype}, not float32" if scaling.dtype != torch.float32 else None,
        "row_part": (f"{tuple(row_part.shape)} is not [{out.shape[1]}]"
                     if row_part.shape != out.shape[1:] else None),
        "tiles": (f"order {tuple(order.shape)}, tiles {tuple(tile_data.shape)} and block_m "
                  f"{block_m} are not [{tokens}], [3, G] and 16 or 64"
                  if order.shape != (tokens,) or tile_data.dim() != 2
                  or tile_data.shape[0] != 3 or block_m not in (16, 64) else None),
        "a, b": (f"{a.dtype} and {b.dtype} are not x's dtype {x.dtype}"
                 if a.dtype != x.dtype or b.dtype != x.dtype else None),
        "norm": (f"weight {tuple(norm[0].shape)} {norm[0].dtype} is not [{k}] {x.dtype}"
                 if norm is not None and (norm[0].shape != (k,) or norm[0].dtype != x.dtype)
                 else None),
        "gated": (f"needs two parts of equal size, not {parts} of {out.shape[1]} rows"
                  if gated and (parts != 2 or out.shape[1] % 2) else None),
    }
    if b.shape != (adapters, out.shape[1], rank):
        problems["b"] = problems["b"] or f"{tuple(b.shape)} is not [{adapters}, {out.shape[1]}, R]"
    for name, problem in problems.items():
        if problem:
            raise ValueError(f"add_lora: {name} {problem}")


def add_deltas(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scaling: torch.Tensor, row_part: torch.Tensor, tiles: LoraTiles) -> None:
    """Add each row's adapter delta to the projection's output ``out [T, N]`` (in place) for
    its input ``x [T, K]``: ``reference.add_lora`` without its norm and gate.

    The rows are those of ``tiles`` (``kernels.lora_tiles``): a tile's rows use its slot (-1:
    none, its rows are left alone). The projection has ``P`` parts (``scaling [S, P]``
    float32: 1 for o/down, 3 for a merged q/k/v, 2 for gate/up); ``a [S, P*R, K]`` holds
    part ``p``'s lora_A in rows ``p*R:(p+1)*R``, ``b [S, N, R]`` output row ``n``'s lora_B
    row, ``row_part [N]`` (int32) the part of each output row (each in ``0..P-1``), both
    zero-padded in ``R`` where an adapter's rank is lower. For a row ``t`` of slot ``s`` and
    output ``n`` of part ``p``:

        out[t, n] += scaling[s, p] * sum_r h[t, p*R + r] * b[s, n, r],  h[t] = a[s] @ x[t]

    Rounding points: ``h`` and its product with ``b`` are float32 (products of the 16-bit
    values, float32 sums), times ``scaling`` in float32; the delta is rounded to ``out``'s
    dtype, then added in it (peft's order: the LoRA branch in the model's dtype, added to the
    base output). A slot's rows are taken together, in their tiles' order (the steps'
    sequences' order), one product a slot.
    """
    num_parts, rank = scaling.shape[1], b.shape[2]
    columns = [torch.nonzero(row_part == p).squeeze(1) for p in range(num_parts)]
    order = tiles.order.tolist()
    by_slot: dict[int, list[int]] = {}
    for slot, first, count in tiles.tiles.T.tolist():
        if slot >= 0:
            by_slot.setdefault(slot, []).extend(order[first:first + count])
    for slot, row_list in by_slot.items():  # few adapters a batch: one product each
        rows = torch.tensor(row_list, device=x.device)
        h = x[rows].float() @ a[slot].float().T
        delta = torch.zeros(rows.numel(), out.shape[1], dtype=torch.float32, device=x.device)
        for p, cols in enumerate(columns):
            part = h[:, p * rank:(p + 1) * rank] @ b[slot, cols].float().T
            delta[:, cols] = part * scaling[slot, p]
        out[rows] += delta.to(out.dtype)
