"""Programmatic dependent launch (Hopper and later): a kernel's programs are placed on the GPU
while the kernel before it still runs, and wait inside for its writes.

At small batches a decode step is about two hundred short kernels, each bound by the latency of
its first loads as much as by its bytes. Launched this way, a kernel's programs are resident as
soon as the previous kernel's are, read what no earlier kernel of the step writes (a
projection's weights) while that kernel finishes, and only then wait for it. Every kernel
launched with ``launch_pdl`` must call ``wait_for_previous`` before its first dependent load and
before any store: once it is past the wait, the kernel before it has finished and its writes are
visible, and so, in turn, are those of every earlier kernel. The next kernel is released only
after the wait, so at most two kernels of a stream overlap.

``HF_PAGED_PDL=0`` launches every kernel plainly (for comparisons); CPU tensors (Triton's
interpreter) and GPUs before Hopper never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (no-op without
    ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _options(device: torch.device) -> dict[str, bool]:
    on = (device.type == "cuda" and os.environ.get("HF_PAGED_PDL", "1") != "0"
          and torch.cuda.get_device_capability(device)[0] >= 9)
    return {"PDL": on, "launch_pdl": on}


def pdl_options(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel with a ``PDL`` constant that calls ``wait_for_previous``,
    on ``tensor``'s device (one cached dict a device: launches only unpack it)."""
    return _options(tensor.device)
