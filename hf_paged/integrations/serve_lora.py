"""``hf-paged serve MODEL --lora NAME=PATH ...``: LoRA adapters served by name beside the base
model, as vLLM's ``--lora-modules``.

- Loading (``load_with_adapters``): transformers' ``ModelManager`` loads ``MODEL`` when it is
  built, before the server starts; each adapter's config is checked against the base model's
  first (no tensor read), then, the model loaded, every adapter is read and loaded into its
  engine, in this process or (``--engine-process``) in the engine's, which reads the folders
  itself. A bad adapter stops the server there with one line naming ``--lora NAME=PATH``.
- Requests (``extend``): a request's ``model`` field selects an adapter by its NAME, the base
  model by its own name (or no name); any other name is a 400 in OpenAI's error shape naming
  it. The request then runs as one of the base model's (transformers' handlers and generation
  managers), its adapter carried from the handler by a context variable (each request is a
  task of its own) to where the manager hands it over: with continuous batching,
  ``adapter=NAME`` added to the continuous-batching manager's ``add_request``; without,
  ``adapter_names=[NAME]`` (PEFT's keyword) added to the inputs ``model.generate`` gets. Its
  response names the adapter as its model, as vLLM's do.
- ``/v1/models`` lists the adapters after the base model, as vLLM lists them (``parent``:
  the base model, ``root``: the adapter's folder).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

from hf_paged.integrations.serve_errors import RefusedRequest
from hf_paged.lora.named import LORA_FLAG, AdapterSpecError, check_loras, load_loras

# The adapter the request being handled asked for (None: the base model).
_REQUESTED: ContextVar[str | None] = ContextVar("hf_paged_adapter", default=None)
_TAGGED = "_hf_paged_adapters"
# transformers' handlers of text generation, by build_server's argument names.
_HANDLERS = ("chat_handler", "completion_handler", "response_handler")


def load_with_adapters(loras: dict[str, str]) -> Callable[[], None]:
    """Have transformers' ``ModelManager`` load ``loras`` into the model named on the command
    line whenever it loads it (at start, and again after ``/reset``). Returns what undoes it."""
    from transformers import AutoConfig
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import split_model_id

    from hf_paged.families.vision_language import causal_lm_config
    from hf_paged.integrations.serve_compat import split_revision

    stock = ModelManager.__dict__["_load_model"]

    def _load_model(self, model_id_and_revision: str, *args, **kwargs):
        pinned = self.force_model  # None: extend refuses --lora before any model loads
        if pinned is None or model_id_and_revision != self.process_model_name(
                split_model_id(pinned)[0]):
            return stock(self, model_id_and_revision, *args, **kwargs)
        model_id, revision = split_revision(model_id_and_revision)
        check_loras(loras, causal_lm_config(AutoConfig.from_pretrained(model_id,
                                                                      revision=revision)))
        model = stock(self, model_id_and_revision, *args, **kwargs)
        try:
            _load_into(model, loras)
        except BaseException:
            if hasattr(model, "close"):  # hf_paged's: its engine (or engine process) goes
                model.close()
            raise
        return model

    ModelManager._load_model = _load_model

    def restore() -> None:
        ModelManager._load_model = stock

    return restore


def _load_into(model, loras: dict[str, str]) -> None:
    from hf_paged.integrations.causal_lm import PagedCausalLM
    from hf_paged.integrations.remote_manager import RemoteModel

    if isinstance(model, RemoteModel):
        model.engine.load_loras(loras)
    elif isinstance(model, PagedCausalLM):
        load_loras(model.engine, loras)
    else:
        raise AdapterSpecError(f"{LORA_FLAG}: {model.name_or_path} loaded with stock "
                               "transformers (see the warning above), which serves no adapter")


def extend(model_manager, generation_state, handlers: dict, loras: dict[str, str]) -> None:
    """Select adapters by the requests' model names in transformers' ``handlers`` (build_server's
    arguments by name) and list them in ``model_manager``'s ``/v1/models``."""
    base = model_manager.force_model
    if base is None:
        raise AdapterSpecError(f"{LORA_FLAG} needs the model named on the command line: "
                               f"hf-paged serve MODEL {LORA_FLAG} NAME=PATH")
    if base in loras:
        raise AdapterSpecError(f"{LORA_FLAG} {base}={loras[base]}: {base!r} names the base "
                               "model; give the adapter another name")
    from transformers.cli.serving.utils import split_model_id

    for name in _HANDLERS:
        _select_by_name(handlers[name], base, loras)
    stock_get_manager = generation_state.get_manager
    base_id = model_manager.process_model_name(split_model_id(base)[0])

    def get_manager(model_id: str, use_cb: bool = False):
        # an adapter's requests are the base model's: its manager, its engine
        model_id = base_id if model_id in loras else model_id
        manager = stock_get_manager(model_id, use_cb=use_cb)
        if not getattr(manager, _TAGGED, False):
            (_pass_adapter if use_cb else _pass_adapter_names)(manager)
            setattr(manager, _TAGGED, True)
        return manager

    generation_state.get_manager = get_manager
    stock_list = model_manager.list_models

    def list_models(*args, **kwargs) -> list[dict]:
        models = stock_list(*args, **kwargs)
        parent = next((m for m in models if m["id"] == base), None)
        extra = {"status": parent["status"]} if parent and "status" in parent else {}
        return models + [{"id": name, "object": "model", "created": 0,
                          "owned_by": parent["owned_by"] if parent else "",
                          "root": path, "parent": base, **extra}
                         for name, path in loras.items()]

    model_manager.list_models = list_models


def _select_by_name(handler, base: str, loras: dict[str, str]) -> None:
    """``handler._resolve_model`` (transformers': the model a body names, as ``(model id,
    model, processor)``) with adapter names: one selects the base model and the adapter, and
    stands as the model id; an unknown name is refused."""
    stock = handler._resolve_model

    def _resolve_model(body: dict):
        requested = body.get("model")
        adapter = requested if requested in loras else None
        if adapter is not None:
            body["model"] = base
        elif requested is not None and requested != base:
            served = ", ".join(repr(name) for name in loras)
            raise RefusedRequest(f"model {requested!r} is not served here: this server serves "
                                 f"{base!r} and its LoRA adapters {served}")
        _REQUESTED.set(adapter)
        model_id, model, processor = stock(body)
        return adapter or model_id, model, processor

    handler._resolve_model = _resolve_model


def _pass_adapter(manager) -> None:
    """Have transformers' ``CBGenerateManager`` add the requested adapter to its
    continuous-batching manager's ``add_request`` calls, once that manager exists."""
    stock_init = manager.init_cb

    def init_cb(model, gen_config) -> None:
        stock_init(model, gen_config)
        cb = manager._cb
        if getattr(cb, _TAGGED, False):
            return
        stock_add = cb.add_request

        def add_request(*args, **kwargs):
            adapter = _REQUESTED.get()
            if adapter is not None:
                kwargs["adapter"] = adapter
            return stock_add(*args, **kwargs)

        cb.add_request = add_request
        setattr(cb, _TAGGED, True)

    manager.init_cb = init_cb


def _pass_adapter_names(manager) -> None:
    """Have transformers' ``GenerateManager`` (``model.generate`` on its inference thread)
    generate with the requested adapter: ``adapter_names=[NAME]`` among the inputs it passes
    as keywords to ``model.generate`` (and to ``serve_errors``' check before it)."""
    for attr in ("generate_streaming", "generate_non_streaming"):
        stock = getattr(manager, attr)

        def generate(model, processor, inputs, *args, _stock=stock, **kwargs):
            adapter = _REQUESTED.get()
            if adapter is not None:
                inputs = {**inputs, "adapter_names": [adapter]}
            return _stock(model, processor, inputs, *args, **kwargs)

        setattr(manager, attr, generate)
