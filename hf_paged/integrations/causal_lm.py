"""The model object a transformers script expects: ``hf_paged.AutoModelForCausalLM``.

``from_pretrained`` takes transformers' loading keywords plus every engine option and returns
hf_paged's ``Qwen3ForCausalLM``: ``generate`` runs on the engine, calling the model computes
transformers' ``CausalLMOutputWithPast`` through the swapped modules, and ``config``,
``generation_config``, ``device``, ``dtype``, ``eval()`` and friends answer as transformers'
own model would.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from hf_paged.config import EngineConfig
from hf_paged.engine.engine import PagedEngine
from hf_paged.modeling.full_forward import full_forward

# transformers' own hub keywords, passed to huggingface_hub to find a checkpoint by id.
_HUB_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
# Accepted and left to the engine, which chooses its own attention and loads weights lazily;
# no code runs from a checkpoint, so the revision of its code means nothing either.
_IGNORED_KEYWORDS = ("attn_implementation", "low_cpu_mem_usage", "code_revision",
                     "_from_pipeline", "_from_auto")
# transformers keywords hf_paged cannot honour: accepted at their defaults (None or False) only.
_REFUSED_UNLESS_DEFAULT = (
    "config", "state_dict", "quantization_config", "variant", "gguf_file", "max_memory",
    "offload_folder", "offload_buffers", "output_loading_info", "adapter_kwargs", "key_mapping",
    "tp_plan", "tp_size", "device_mesh", "distributed_config", "use_kernels", "kernel_config",
)
# Keywords taken by hf_paged: transformers' placement ones, then every EngineConfig field.
_ENGINE_KEYWORDS = (
    "dtype", "torch_dtype", "device_map", "device", "subfolder", "generation_config",
    *(f.name for f in dataclasses.fields(EngineConfig)),
)
# device_map strategies that accelerate spreads over GPUs; the engine takes the first one.
_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")
# Keywords of transformers' loss function, passed on with ``labels``.
_LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")


class Qwen3ForCausalLM(nn.Module):
    """A Qwen3 causal LM served by a ``PagedEngine``: ``generate`` runs on the engine, and
    calling the model returns transformers' outputs computed by the same swapped modules.

    It bears transformers' class name because pipelines check models by that name."""

    main_input_name = "input_ids"

    def __init__(self, engine: PagedEngine):
        super().__init__()
        self.engine = engine
        # transformers' module tree (``model.layers...``, ``lm_head``), for scripts that look.
        self.model = engine.model.hf_model.model
        self.lm_head = engine.model.hf_model.lm_head
        super().train(False)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        **kwargs) -> Qwen3ForCausalLM:
        """See ``AutoModelForCausalLM.from_pretrained``."""
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                    **kwargs)

    # ---- what scripts read --------------------------------------------------------------

    @property
    def config(self):
        return self.engine.hf_config

    @property
    def generation_config(self):
        return self.engine.generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.engine.generation_config = value

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.runner.dtype

    @property
    def name_or_path(self) -> str:
        return self.config._name_or_path

    def can_generate(self) -> bool:
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count: each parameter once (tied ones too), the input embedding left
        out with ``exclude_embeddings``; nothing here trains."""
        if only_trainable:
            return 0
        skip = self.model.embed_tokens.weight if exclude_embeddings else None
        return sum(p.numel() for p in self.parameters() if p is not skip)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    # ---- inference only, on the device it was loaded on ---------------------------------

    def train(self, mode: bool = True) -> Qwen3ForCausalLM:
        if mode:
            raise RuntimeError("hf_paged models are for inference only; train(True) is refused")
        return super().train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Qwen3ForCausalLM:
        if requires_grad:
            raise RuntimeError("hf_paged models are for inference only; requires_grad_(True) "
                               "is refused")
        return self

    def to(self, *args, **kwargs) -> Qwen3ForCausalLM:
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

    def cuda(self, device=None) -> Qwen3ForCausalLM:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> Qwen3ForCausalLM:
        return self.to("cpu")

    def half(self) -> Qwen3ForCausalLM:
        return self.to(torch.float16)

    def bfloat16(self) -> Qwen3ForCausalLM:
        return self.to(torch.bfloat16)

    def float(self) -> Qwen3ForCausalLM:
        return self.to(torch.float32)

    # ---- generation and scoring ---------------------------------------------------------

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """transformers' ``generate`` (same arguments, same result), run by the engine."""
        return self.engine.generate(inputs, generation_config, **kwargs)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """transformers' ``Qwen3ForCausalLM.forward`` (SDPA attention) over whole sequences,
        on a scratch cache. It keeps no KV cache: ``past_key_values`` is None; decode with
        ``generate``."""
        _refuse_forward_options(past_key_values, inputs_embeds, use_cache, kwargs)
        if self.engine.closed:
            raise RuntimeError("this model was closed; load it again to use it")
        if self.engine.config.tensor_parallel_size > 1:  # the other ranks only follow steps
            raise ValueError("the model call (forward) runs in one process: it is not available "
                             "with tensor_parallel_size > 1; generate() is")
        input_ids = _check_input_ids(input_ids, self.config.vocab_size)
        attention_mask = _attention_mask(attention_mask, input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if position_ids.shape[-1] != input_ids.shape[1] or position_ids.dim() > 2:
            raise ValueError(f"position_ids must have shape [batch, {input_ids.shape[1]}], "
                             f"got {tuple(position_ids.shape)}")
        hidden = full_forward(self.engine.model, input_ids, attention_mask, position_ids,
                              self.engine.config.block_size)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep.to(hidden.device)]
        with torch.no_grad():
            logits = self.lm_head(hidden).to(input_ids.device)
            loss = None
            if labels is not None:
                loss_kwargs = {n: v for n, v in kwargs.items() if n in _LOSS_KEYWORDS}
                loss = self.engine.model.hf_model.loss_function(
                    logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs
                )
        output = CausalLMOutputWithPast(loss=loss, logits=logits)
        return output.to_tuple() if return_dict is False else output

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Free the weights, KV cache and CUDA graphs; see ``PagedEngine.close``."""
        self.engine.close()

    def __enter__(self) -> Qwen3ForCausalLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AutoModelForCausalLM:
    """``transformers.AutoModelForCausalLM`` for Qwen3 checkpoints, served by hf_paged."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *model_args, **kwargs
    ) -> Qwen3ForCausalLM:
        """Load like ``transformers.AutoModelForCausalLM.from_pretrained``.

        Accepts transformers' ``dtype``/``torch_dtype`` (a dtype, its name or ``"auto"``,
        the default: the checkpoint's), ``device_map`` (``None``/``"auto"``: the first GPU,
        else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` or ``{"": N}``), the hub's
        ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download`` and
        ``proxies``, ``subfolder``, ``generation_config``, ``trust_remote_code=False``,
        ``use_safetensors``, and ignores ``attn_implementation`` and ``low_cpu_mem_usage``
        (the engine chooses). Every ``EngineConfig`` field may be passed too. transformers
        keywords it cannot honour (``quantization_config``, ``config``, ...) raise a
        ``ValueError`` unless None; unknown ones a ``TypeError``.
        """
        if model_args:
            raise TypeError("from_pretrained() takes the checkpoint and keyword arguments only")
        return Qwen3ForCausalLM(load_engine(os.fspath(pretrained_model_name_or_path), kwargs))


def load_engine(path_or_id: str, kwargs: dict) -> PagedEngine:
    """A ``PagedEngine`` from transformers-style ``from_pretrained`` keywords."""
    kwargs = dict(kwargs)
    engine_options = {n: kwargs.pop(n) for n in _ENGINE_KEYWORDS if n in kwargs}
    hub = {name: kwargs.pop(name) for name in _HUB_KEYWORDS if name in kwargs}
    for name in _IGNORED_KEYWORDS:
        kwargs.pop(name, None)
    if kwargs.pop("trust_remote_code", None):
        raise ValueError("trust_remote_code=True is refused: hf_paged runs no code from a "
                         "checkpoint (safetensors weights of known architectures only)")
    if kwargs.pop("use_safetensors", None) is False:
        raise ValueError("use_safetensors=False is refused: hf_paged loads safetensors only")
    refused = sorted(n for n in _REFUSED_UNLESS_DEFAULT if kwargs.pop(n, None) not in (None, False))
    if refused:
        raise ValueError(f"from_pretrained(): {', '.join(refused)} not supported by hf_paged")
    if kwargs:
        raise TypeError(
            f"from_pretrained() got keyword(s) hf_paged does not know: "
            f"{', '.join(sorted(kwargs))}; engine options: {', '.join(sorted(_ENGINE_KEYWORDS))}"
        )
    dtype = engine_options.pop("torch_dtype", None)
    if dtype is not None:  # transformers' own deprecation notice, as its loader gives it
        logging.get_logger("transformers.modeling_utils").warning_once(
            "`torch_dtype` is deprecated! Use `dtype` instead!")
    dtype = engine_options.pop("dtype", None) or dtype
    if "device_map" in engine_options:
        if engine_options.get("device") is not None:
            raise ValueError("pass device_map or device, not both")
        engine_options["device"] = resolve_device_map(engine_options.pop("device_map"))
    generation_config = engine_options.pop("generation_config", None)
    path = os.path.join(resolve_checkpoint(path_or_id, hub), engine_options.pop("subfolder", ""))
    engine = PagedEngine.from_pretrained(
        path, dtype=None if dtype == "auto" else dtype, **engine_options
    )
    if generation_config is not None:
        engine.generation_config = generation_config
    engine.hf_config._name_or_path = path_or_id
    return engine


def resolve_checkpoint(path_or_id: str, hub: dict) -> str:
    """A local folder as is; a hub id through huggingface_hub with transformers' keywords."""
    if os.path.isdir(path_or_id):
        return path_or_id
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt"], **hub
        )
    except Exception as error:
        raise OSError(
            f"{path_or_id!r} is not a local folder and could not be fetched from the hub: {error}"
        ) from error


def resolve_device_map(device_map) -> torch.device | None:
    """The one device a transformers ``device_map`` names (``None``: the engine's default)."""
    if device_map is None or device_map in _DEVICE_MAP_STRATEGIES:
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(
                f"device_map spreads the model over {sorted(map(str, devices))}; hf_paged keeps "
                "a model on one device: to split it over GPUs, use tensor parallelism "
                "(tensor_parallel_size=N)"
            )
        device_map = devices.pop()
    try:
        device = torch.device("cuda", device_map) if isinstance(device_map, int) else (
            torch.device(device_map))
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device_map must name one CPU or CUDA device (None, 'auto', 'cpu', "
                         f"'cuda', 'cuda:N', N or {{'': N}}), got {device_map!r}")
    return device


def _check_input_ids(input_ids, vocab_size: int) -> torch.Tensor:
    """Raise ValueError naming ``input_ids`` unless it is a 2-D tensor of in-vocabulary ids."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise ValueError(f"input_ids must be a 2-D tensor [batch, seq_len], got "
                         f"{type(input_ids).__name__} of shape {shape}")
    if input_ids.dtype not in (torch.int16, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold token ids as int16, int32 or int64, got "
                         f"{input_ids.dtype} (8-bit types cannot hold a vocabulary's ids)")
    if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab_size})")
    return input_ids


def _attention_mask(mask, input_ids: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {shape}")
    return mask


def _refuse_forward_options(past_key_values, inputs_embeds, use_cache, kwargs) -> None:
    if past_key_values is not None or use_cache:
        raise ValueError("past_key_values/use_cache: hf_paged's forward keeps no KV cache; pass "
                         "whole sequences, or decode with generate()")
    if inputs_embeds is not None:
        raise ValueError("inputs_embeds is not supported by hf_paged's forward; pass input_ids")
    refused = sorted(n for n, v in kwargs.items()
                     if n not in _LOSS_KEYWORDS and v is not None and v is not False)
    if refused:
        raise ValueError(f"forward() got argument(s) hf_paged does not support: "
                         f"{', '.join(refused)}")


def _same_device(wanted: torch.device, actual: torch.device) -> bool:
    if wanted.type != actual.type:
        return False
    index = wanted.index if wanted.index is not None else (
        torch.cuda.current_device() if wanted.type == "cuda" else None)
    return index == actual.index
