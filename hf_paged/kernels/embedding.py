"""Token embedding with the step's pending tokens resolved on the device, in one launch.

A decode step's input ids are partly unknown to the host: a token the previous step drew is
still on the device when the host launches the next step (``src >= 0`` names its row among the
previous step's samples). Picking those out (a clamp, a gather, a compare and a select) and
then embedding took five launches a step; at batch 1 each costs about as much as it would for
a whole batch. Here a program reads its row's id (or pending token) and copies the embedding
row, zeros for a token outside this rank's vocabulary slice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch

_BLOCK = 1024


# ids and src may be views into a graph's packed inputs at any offset (see kernels.attention).
@triton.jit(do_not_specialize_on_alignment=["ids_ptr", "src_ptr"])
def _embed_kernel(ids_ptr, src_ptr, last_ptr, weight_ptr, out_ptr, vocab_start, shard_rows,
                  hidden, w_s0, out_s0, PENDING: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    wait_for_previous(PDL)  # the pending tokens are the previous step's writes
    token = tl.load(ids_ptr + row).to(tl.int64)
    if PENDING:
        src = tl.load(src_ptr + row)
        if src >= 0:
            token = tl.load(last_ptr + src).to(tl.int64)
    local = token - vocab_start
    inside = (local >= 0) & (local < shard_rows)
    columns = tl.where(inside, hidden, 0)  # none read for a token outside: zeros
    values = tl.load(weight_ptr + tl.where(inside, local, 0) * w_s0 + cols,
                     mask=cols < columns, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * out_s0 + cols, values, mask=cols < hidden)


def embed(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int = 0,
          src: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Triton twin of ``reference.embed``."""
    assert weight.stride(1) == 1
    rows, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty((rows, hidden), dtype=weight.dtype, device=weight.device)
    if rows:
        pending = src is not None
        block = min(_BLOCK, triton.next_power_of_2(hidden))
        launch(_embed_kernel, (rows, triton.cdiv(hidden, block)),
               ids, src if pending else ids, last_tokens if pending else ids, weight, out,
               vocab_start, weight.shape[0], hidden, weight.stride(0), out.stride(0),
               PENDING=pending, BLOCK=block, **pdl_options(weight))
    return out
