"""The model object a transformers script expects: transformers' own class of the checkpoint's
family (``Qwen3ForCausalLM``, ...).

``hf_paged.Qwen3ForCausalLM`` subclasses transformers' class (``PagedCausalLM`` in front, see
``family_classes``), so ``isinstance`` checks hold and every attribute a client reads
(``loss_type``, ``tie_weights``, ``get_decoder``, ``prepare_inputs_for_generation``,
``is_gradient_checkpointing``, ...) is transformers' own by inheritance. An instance is built
by transformers' constructor on the meta device, then its ``model`` and ``lm_head`` children
are replaced by the engine's swapped modules: the weights exist once, in the engine.
``generate`` runs on the engine; the forward computes transformers' outputs through the same
modules; what the engine cannot do (training, resizing, moving) raises.
"""

from __future__ import annotations

import os
import weakref
from types import ModuleType

import torch
from transformers import modeling_outputs
from transformers.modeling_outputs import ModelOutput

from hf_paged import families
from hf_paged.generation.paged_engine import PagedEngine
from hf_paged.integrations import continuous_batching, peft_parts, peft_sync
from hf_paged.integrations.data_parallel import DataParallelEngine
from hf_paged.integrations.family_classes import class_by_name, family_class
from hf_paged.integrations.inference_only import InferenceOnly
from hf_paged.integrations.loading import adapter_and_base, load_engine
from hf_paged.integrations.model_call import (
    forward_inputs,
    inner_model_class,
    past_tokens,
    refuse_forward_options,
    row_adapters,
    wants_hidden_states,
)
from hf_paged.integrations.past_tokens import kept_of_new, past_argument, with_past
from hf_paged.integrations.state_dict import transformers_state_dict

# Keywords of transformers' loss function, passed on with ``labels``.
_LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")


class PagedCausalLM(InferenceOnly):
    """transformers' causal LM with hf_paged's modules swapped in, served by a ``PagedEngine``
    (``model.engine``). It keeps transformers' class name because pipelines check models by
    that name."""

    @classmethod
    def from_engine(cls, engine: PagedEngine) -> PagedCausalLM:
        """transformers' constructor on the meta device (nothing allocated), then the engine's
        modules as its children."""
        with torch.device("meta"):
            model = cls(engine.hf_config)
        model.engine = engine  # first: the generation_config property reads it
        inner = engine.model.hf_model.model
        # transformers' inner model, its forward the engine's
        inner.__class__ = inner_model_class(families.family_for(engine.hf_config))
        inner.engine_ref = weakref.ref(engine)  # not a strong one: the engine holds ``inner``
        model.model = inner
        model.lm_head = engine.model.hf_model.lm_head
        # A vision-language release's keys: saved in their layout (transformers' attribute)
        model._weight_conversions = getattr(engine.model.hf_model, "_weight_conversions", None)
        peft_parts.install(model)
        torch.nn.Module.train(model, False)
        return model

    @classmethod
    def from_replicas(cls, front: DataParallelEngine) -> PagedCausalLM:
        """transformers' constructor on the meta device, served by data-parallel replicas:
        the weights are theirs, in their processes; ``generate`` and the model call (the inner
        model's too) run there."""
        with torch.device("meta"):
            model = cls(front.hf_config)
        model.engine = front
        model.model.__class__ = inner_model_class(families.family_for(front.hf_config))
        model.model.engine_ref = weakref.ref(front)
        torch.nn.Module.train(model, False)
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        **kwargs) -> PagedCausalLM:
        """See ``AutoModelForCausalLM.from_pretrained``."""
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                    **kwargs)

    # ---- what lives in the engine ---------------------------------------------------------

    @property
    def generation_config(self):
        engine = self.__dict__.get("engine")
        return engine.generation_config if engine else self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, value) -> None:
        # transformers' constructor sets one before the engine is attached; the engine's wins.
        engine = self.__dict__.get("engine")
        if engine is None:
            self.__dict__["_generation_config"] = value
        else:
            engine.generation_config = value

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count: each parameter once (tied ones too), the input embedding left
        out with ``exclude_embeddings``; nothing here trains."""
        if only_trainable:
            return 0
        skip = self.model.embed_tokens.weight if exclude_embeddings else None
        return sum(p.numel() for p in self.parameters() if p is not skip)

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """transformers' layout: the fused projections split back into their checkpoint
        tensors, so ``save_pretrained`` writes what stock ``from_pretrained`` reads."""
        if self.engine.config.tensor_parallel_size > 1:
            raise ValueError("state_dict()/save_pretrained(): this process holds one rank's "
                             "shard of the weights (tensor_parallel_size > 1)")
        if self.engine.config.data_parallel_size > 1:
            raise ValueError("state_dict()/save_pretrained(): the weights live in the "
                             "replicas' processes (data_parallel_size > 1)")
        return transformers_state_dict(super().state_dict(*args, **kwargs), self.config)

    # ---- generation and scoring -----------------------------------------------------------

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """transformers' ``generate`` (same arguments, same result), run by the engine; with
        peft's adapters on the model, on the adapter peft would run each row on (with
        ``data_parallel_size > 1``: the adapters the replicas loaded, by ``adapter_names``)."""
        if self.engine.config.data_parallel_size > 1:
            return self.engine.generate(inputs, generation_config, **kwargs)
        adapters = peft_sync.sync(self, self.engine)
        if adapters is not None and kwargs.get("adapter_names") is None:
            kwargs["adapter_names"] = adapters
        return self.engine.generate(inputs, generation_config, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None
                                 ) -> continuous_batching.PagedContinuousBatchingManager:
        """transformers' ``init_continuous_batching``: its ``ContinuousBatchingManager``
        interface, the requests served by the engine (``integrations/continuous_batching.py``).
        ``generate_batch`` and ``continuous_batching_context_manager``, transformers' own,
        go through it. A request runs on the adapter it names (``add_request(...,
        adapter=NAME)``), else on peft's active adapter when the manager was made."""
        if self.engine.config.data_parallel_size > 1:
            raise NotImplementedError("init_continuous_batching is not supported with "
                                      "data_parallel_size > 1: use generate, or hf-paged serve")
        manager = continuous_batching.init_continuous_batching(
            self, generation_config, continuous_batching_config, workload_hints)
        active = peft_sync.sync(self, self.engine)
        manager.settings.default_adapter = active[0] if active else None
        return manager

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
    ) -> ModelOutput | tuple:
        """transformers' causal LM forward (SDPA attention) over whole sequences on a scratch
        cache, in the family's output class (``CausalLMOutputWithPast``, ...). Its
        ``past_key_values`` holds the tokens so far (``integrations/past_tokens.py``): given
        back, the call recomputes them with the new ones; decode with ``generate``."""
        past_key_values = past_argument(past_key_values, kwargs)
        streams = wants_hidden_states(kwargs, self.config)
        refuse_forward_options(inputs_embeds, kwargs, _LOSS_KEYWORDS)
        if kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", None)):
            raise ValueError("output_router_logits (set in the config): hf_paged's forward "
                             "returns no router logits and no load-balancing loss")
        *whole, past_length = with_past(past_key_values, input_ids, attention_mask, position_ids)
        inputs = forward_inputs(*whole, self.config.vocab_size)
        if past_length:  # transformers' logits are the new tokens'
            logits_to_keep = kept_of_new(logits_to_keep, past_length, input_ids.shape[1])
        # (a data-parallel front holds no adapters and refuses the call by name)
        adapters = (None if self.engine.config.data_parallel_size > 1 else
                    row_adapters(peft_sync.sync(self, self.engine), input_ids.shape[0]))
        logits = self.engine.forward(*inputs, logits_to_keep, adapters, streams)
        if streams:
            logits, *streams = logits
            streams = tuple(s[:, past_length:].to(input_ids.device) for s in streams)
        logits = logits.to(input_ids.device)
        with torch.no_grad():
            loss = None
            if labels is not None:
                loss_kwargs = {n: v for n, v in kwargs.items() if n in _LOSS_KEYWORDS}
                loss = self.loss_function(logits=logits, labels=labels,
                                          vocab_size=self.config.vocab_size, **loss_kwargs)
        output_class = getattr(modeling_outputs, families.family_for(self.config).OUTPUT)
        output = output_class(loss=loss, logits=logits,
                              past_key_values=past_tokens(inputs, past_key_values, use_cache,
                                                          self.config),
                              hidden_states=streams or None)
        if return_dict is None:
            return_dict = self.config.return_dict
        return output if return_dict else output.to_tuple()

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Free the weights, KV cache and CUDA graphs; see ``PagedEngine.close``."""
        self.engine.close()

    def __enter__(self) -> PagedCausalLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def causal_lm_class(family: ModuleType) -> type[PagedCausalLM]:
    """The family's drop-in class (``hf_paged.families``)."""
    return family_class(PagedCausalLM, family.ARCHITECTURE, __name__)


def __getattr__(name: str) -> type:
    return class_by_name(PagedCausalLM, name, __name__, "ARCHITECTURE")


class AutoModelForCausalLM:
    """``transformers.AutoModelForCausalLM`` for the checkpoints hf_paged supports
    (``hf_paged.families``), served by hf_paged: the drop-in class of the checkpoint's
    family."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *model_args, **kwargs
    ) -> PagedCausalLM:
        """Load like ``transformers.AutoModelForCausalLM.from_pretrained``.

        Accepts transformers' ``dtype``/``torch_dtype`` (a dtype, its name or ``"auto"``,
        the default: the checkpoint's), ``device_map`` (``None``/``"auto"``: the first GPU,
        else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` or ``{"": N}``), the hub's
        ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download`` and
        ``proxies``, ``subfolder``, ``generation_config``, ``config`` (an object or a path),
        ``trust_remote_code=False``, ``use_safetensors``, and ignores ``attn_implementation``
        and ``low_cpu_mem_usage`` (the engine chooses). Every ``EngineConfig`` field may be
        passed too. Other keywords that name attributes of the model config override them, as
        in transformers (those the engine cannot honour raise a ``ValueError``);
        ``quantization_config`` quantizes a float checkpoint on load (fine-grained FP8 only);
        transformers keywords it cannot honour (``variant``, ...) raise a ``ValueError`` unless
        None; unknown ones a ``TypeError``. A peft adapter's folder loads the base checkpoint
        its ``adapter_config.json`` names, then the adapter (``load_adapter``), as in
        transformers.
        """
        if model_args:
            raise TypeError("from_pretrained() takes the checkpoint and keyword arguments only")
        if kwargs.get("data_parallel_size", 1) != 1:  # the replicas load the rest themselves
            front = DataParallelEngine(os.fspath(pretrained_model_name_or_path), kwargs)
            family = families.family_for(front.hf_config)
            return causal_lm_class(family).from_replicas(front)
        adapter, base = adapter_and_base(os.fspath(pretrained_model_name_or_path), kwargs)
        engine = load_engine(base, kwargs)
        model = causal_lm_class(families.family_for(engine.hf_config)).from_engine(engine)
        if adapter is not None:  # transformers' own (PeftAdapterMixin), served by peft_sync
            model.load_adapter(adapter)
        return model
