"""Plain-torch twin of the causal-convolution kernels: the short depthwise convolution of the
Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over a packed batch, each sequence's last inputs
kept in a slot of a state pool (``reference`` re-exports it beside every other twin).

The arithmetic is transformers' torch path (``causal_conv1d_fn`` / ``causal_conv1d_update``):
``F.conv1d`` in the weight's dtype, the activation on its result, then a cast to the input's
dtype. The state follows transformers' cache (``LinearAttentionLayer.update_conv_state``):
the last ``S`` inputs of the sequence, oldest first, in the inputs' dtype, ``[C, S]``; a
sequence shorter than ``S`` shifts its inputs into the old state. transformers keeps ``S =
kernel_size``, of which the convolution reads the last ``kernel_size - 1``; any ``S >=
kernel_size - 1`` is served.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")  # transformers' names of the SiLU (ACT2FN)


def check_conv(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               conv_pool: torch.Tensor, slots: torch.Tensor, activation: str | None,
               cu_seqlens: torch.Tensor | None = None,
               has_initial: torch.Tensor | None = None) -> None:
    """Raise a ValueError naming the first argument of ``name`` whose shape or dtype does not
    fit the others (both twins call it; values on the device are not read)."""
    channels = x.shape[-1]
    width = weight.shape[-1]
    batch = slots.shape[0]
    problems = {
        "x": f"{tuple(x.shape)} is not [T, C]" if x.dim() != 2 else None,
        "weight": (f"{tuple(weight.shape)} is not [{channels}, W >= 2]"
                   if weight.dim() != 2 or weight.shape[0] != channels or width < 2 else None),
        "bias": (f"{tuple(bias.shape)} is not [{channels}]"
                 if bias is not None and bias.shape != (channels,) else None),
        "conv_pool": (f"{tuple(conv_pool.shape)} {conv_pool.dtype} is not [N, {channels}, "
                      f"S >= {width - 1}] {x.dtype}"
                      if conv_pool.dim() != 3 or conv_pool.shape[1] != channels
                      or conv_pool.shape[2] < width - 1 or conv_pool.dtype != x.dtype
                      else None),
        "slots": f"{tuple(slots.shape)} {slots.dtype} is not [B] int32" if (
            slots.dim() != 1 or slots.dtype != torch.int32) else None,
        "cu_seqlens": f"{tuple(cu_seqlens.shape)} is not [{batch + 1}] int32" if (
            cu_seqlens is not None and (cu_seqlens.shape != (batch + 1,)
                                        or cu_seqlens.dtype != torch.int32)) else None,
        "has_initial": f"{tuple(has_initial.shape)} is not [{batch}]" if (
            has_initial is not None and has_initial.shape != (batch,)) else None,
        "activation": (f"{activation!r} is not one of {ACTIVATIONS}"
                       if activation not in ACTIVATIONS else None),
    }
    if name == "causal_conv_decode" and x.shape[0] != batch:
        problems["x"] = problems["x"] or f"{tuple(x.shape)} is not [{batch}, C] (one row a slot)"
    for arg, problem in problems.items():
        if problem:
            raise ValueError(f"{name}: {arg} {problem}")


def causal_conv_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        cu_seqlens: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                        has_initial: torch.Tensor, activation: str | None = "silu"
                        ) -> torch.Tensor:
    """The causal depthwise convolution of ``x [T, C]`` by ``weight [C, W]`` (+ ``bias [C]``),
    then ``activation`` (``"silu"`` or None), per sequence of a packed batch; returns ``[T, C]``.

    Sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (int32 ``[B+1]``) and state slot
    ``slots[i]`` (int32 ``[B]``) of ``conv_pool [N, C, S]``: its rows are convolved after the
    slot's state where ``has_initial[i]`` (a continued prefill), after zeros otherwise (a new
    sequence), and the slot then holds the sequence's last ``S`` inputs (see the module's
    docstring). A negative slot reads zeros and keeps nothing (padding); rows past
    ``cu_seqlens[-1]`` come out zero. Slots not in the batch are left alone.
    """
    check_conv("causal_conv_prefill", x, weight, bias, conv_pool, slots, activation,
               cu_seqlens, has_initial)
    (tokens, channels), width = x.shape, weight.shape[1]
    batch, state_len = slots.shape[0], conv_pool.shape[2]
    device = x.device
    # One strip for the whole batch: each sequence's state, then its rows. A convolution
    # without padding over the strip gives every row exactly its own sequence's window.
    cu = cu_seqlens.long()
    rows = torch.arange(tokens, device=device)
    seq = torch.searchsorted(cu[1:], rows, right=True)  # batch: a padding row
    row_pos = rows + (seq + 1) * state_len
    state_pos = ((cu[:-1] + torch.arange(batch, device=device) * state_len)[:, None]
                 + torch.arange(state_len, device=device))
    keep = (has_initial.bool() & (slots >= 0))[:, None, None]
    states = torch.where(keep, conv_pool[slots.long().clamp(min=0)], 0)
    strip = x.new_zeros(tokens + (batch + 1) * state_len, channels)
    strip[state_pos.flatten()] = states.transpose(1, 2).reshape(-1, channels)
    strip[row_pos] = x
    out = F.conv1d(strip.T[None].to(weight.dtype), weight[:, None, :], bias, groups=channels)[0]
    if activation is not None:
        out = F.silu(out)
    out = out.T[row_pos - (width - 1)].to(x.dtype)
    out = torch.where((seq < batch)[:, None], out, 0)
    lens = (cu[1:] - cu[:-1])[:, None]
    new_states = strip[state_pos + lens].transpose(1, 2)
    live = slots >= 0
    conv_pool[slots[live].long()] = new_states[live]
    return out


def causal_conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_pool: torch.Tensor, slots: torch.Tensor,
                       activation: str | None = "silu",
                       has_initial: torch.Tensor | None = None) -> torch.Tensor:
    """One token a sequence, ``x [B, C]``: ``causal_conv_prefill`` of one-row sequences that
    continue from their slots (transformers' ``causal_conv1d_update``), states rolled in
    place; where ``has_initial [B]`` is given and False, the sequence starts from zeros (its
    first token, a one-token prompt: a step of one token a sequence need not be all decode
    rows)."""
    check_conv("causal_conv_decode", x, weight, bias, conv_pool, slots, activation,
               has_initial=has_initial)
    batch = slots.shape[0]
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    if has_initial is None:
        has_initial = torch.ones(batch, dtype=torch.bool, device=x.device)
    return causal_conv_prefill(x, weight, bias, cu_seqlens, conv_pool, slots, has_initial,
                               activation)
