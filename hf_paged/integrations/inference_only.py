"""What an hf_paged model refuses or turns into a no-op because it is an engine: training,
gradients, resizing or replacing the embeddings, copies, and moves to another device or
dtype (transformers' ``nn.Module`` methods, answered with a one-line error naming what to do
instead)."""

from __future__ import annotations

import torch

_INFERENCE_ONLY = "hf_paged models are for inference only"


class InferenceOnly:
    """Mixed in before transformers' model class (``super()`` is that class)."""

    def train(self, mode: bool = True) -> InferenceOnly:
        if mode:
            raise RuntimeError(f"{_INFERENCE_ONLY}; train(True) is refused")
        return super().train(False)

    def requires_grad_(self, requires_grad: bool = True) -> InferenceOnly:
        if requires_grad:
            raise RuntimeError(f"{_INFERENCE_ONLY}; requires_grad_(True) is refused")
        return self

    def gradient_checkpointing_enable(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{_INFERENCE_ONLY}; gradient_checkpointing_enable() is refused")

    def enable_input_require_grads(self) -> None:
        raise RuntimeError(f"{_INFERENCE_ONLY}; enable_input_require_grads() is refused")

    def resize_token_embeddings(self, new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None, mean_resizing: bool = True):
        """To the size the embedding has (scripts call it with ``len(tokenizer)`` as a matter of
        course), transformers' answer: the embedding. Any other size raises."""
        size = self.config.vocab_size if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        if size == self.config.vocab_size:
            return self.get_input_embeddings()
        raise RuntimeError(f"resize_token_embeddings({new_num_tokens}) is refused: the engine's "
                           f"embedding, LM head and compiled kernels are sized for the "
                           f"checkpoint's {self.config.vocab_size} tokens")

    def set_input_embeddings(self, value) -> None:
        raise RuntimeError("set_input_embeddings() is refused: the engine serves the loaded "
                           "modules; load another checkpoint instead")

    def set_output_embeddings(self, new_embeddings) -> None:
        raise RuntimeError("set_output_embeddings() is refused: the engine serves the loaded "
                           "modules; load another checkpoint instead")

    def __deepcopy__(self, memo) -> InferenceOnly:
        raise RuntimeError("copy.deepcopy() is refused: an hf_paged model is an engine (KV cache, "
                           "CUDA graphs, worker processes); load the checkpoint again for a "
                           "second one")

    def to(self, *args, **kwargs) -> InferenceOnly:
        """A no-op to the device and dtype the model has; anything else is an error (load the
        model again with ``device_map=``/``dtype=`` instead)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and not _same_device(device, self.device):
            raise ValueError(
                f"to(): this hf_paged model lives on {self.device} and cannot move to {device}; "
                f"load it with from_pretrained(..., device_map={str(device)!r}) instead"
            )
        if dtype is not None and dtype != self.dtype:
            raise ValueError(
                f"to(): this hf_paged model holds {self.dtype} weights and cannot convert them "
                f"to {dtype}; load it with from_pretrained(..., dtype={dtype}) instead"
            )
        return self

    def cuda(self, device=None) -> InferenceOnly:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> InferenceOnly:
        return self.to("cpu")

    def half(self) -> InferenceOnly:
        return self.to(torch.float16)

    def bfloat16(self) -> InferenceOnly:
        return self.to(torch.bfloat16)

    def float(self) -> InferenceOnly:
        return self.to(torch.float32)


def _same_device(wanted: torch.device, actual: torch.device) -> bool:
    if wanted.type != actual.type:
        return False
    index = wanted.index if wanted.index is not None else (
        torch.cuda.current_device() if wanted.type == "cuda" else None)
    return index == actual.index
