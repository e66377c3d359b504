"""``hf-paged serve`` of a vision-language release hf_paged serves as its text model (Qwen3.5's
``Qwen3_5ForConditionalGeneration`` checkpoints, ``families.vision_language``).

transformers' server loads such a checkpoint as a multimodal model: with
``AutoModelForMultimodalLM`` and the release's multimodal processor (its image and video
processors beside the tokenizer). Under ``hf-paged serve`` (``load_text_models``):

- ``AutoModelForMultimodalLM.from_pretrained`` is patched as ``patch_transformers`` patches
  ``AutoModelForCausalLM``'s: a release hf_paged serves loads on hf_paged as its text model
  (the model ``hf_paged.AutoModelForCausalLM.from_pretrained`` returns), any other checkpoint
  with stock transformers. With ``--engine-process`` the engine process loads it so already.
- The processor is the release's tokenizer: the text model reads token ids alone, and the
  image and video processors would need the vision libraries (PIL, torchvision) to load.
  transformers' handlers then treat the model as a text LLM, which drops a message's image,
  video and audio parts without a word.

So a chat or responses request to a model hf_paged serves that carries such a part is refused
(``refuse_media``) with a 400 naming the part, before it is tokenised; other requests go on.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.integrations.serve_errors import RefusedRequest

# Content parts transformers' handlers read as text (chat completions', the Responses API's).
TEXT_PARTS = ("text", "input_text", "output_text")
# transformers' handlers of requests with messages, by build_server's argument names.
_HANDLERS = ("chat_handler", "response_handler")


def load_text_models() -> Callable[[], None]:
    """Have transformers' server load the vision-language releases hf_paged serves as their
    text model, with their tokenizer as the processor; before any server starts (a model named
    on the command line loads when the manager is built). Returns what undoes it."""
    import transformers
    from transformers.cli.serving.model_manager import ModelManager

    from hf_paged.integrations.patch import patch_loader, unpatch_loader

    multimodal = getattr(transformers, "AutoModelForMultimodalLM", None)
    if multimodal is not None:  # the loader transformers' server takes for these releases
        patch_loader(multimodal)
    stock = ModelManager.__dict__["_load_processor"]

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        if gguf_file is not None or not _served_as_text(self, model_id_and_revision):
            return stock(self, model_id_and_revision, gguf_file=gguf_file)
        from transformers import AutoTokenizer

        from hf_paged.integrations.serve_compat import split_revision

        model_id, revision = split_revision(model_id_and_revision)
        return AutoTokenizer.from_pretrained(model_id, revision=revision,
                                             trust_remote_code=self.trust_remote_code)

    ModelManager._load_processor = _load_processor

    def restore() -> None:
        ModelManager._load_processor = stock
        if multimodal is not None:
            unpatch_loader(multimodal)

    return restore


def _served_as_text(manager, model_id_and_revision: str) -> bool:
    """Whether hf_paged serves the checkpoint as a vision-language release's text model, with
    the quantization ``manager`` (transformers' ``ModelManager``) would load it with."""
    from transformers import AutoConfig

    from hf_paged.families.vision_language import causal_lm_config
    from hf_paged.integrations.patch import quantization_refused
    from hf_paged.integrations.serve_compat import split_revision

    model_id, revision = split_revision(model_id_and_revision)
    try:
        config = AutoConfig.from_pretrained(model_id, revision=revision,
                                            trust_remote_code=manager.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return False  # transformers' own loaders then report why
    text = causal_lm_config(config)
    if text is config:
        return False
    quantization = manager.get_quantization_config()
    asked = {} if quantization is None else {"quantization_config": quantization}
    return quantization_refused(text, asked) is None


def refuse_media(handlers: dict) -> None:
    """Refuse image, video and audio parts of requests to hf_paged's models in transformers'
    ``handlers`` (build_server's arguments by name)."""
    for name in _HANDLERS:
        handler = handlers.get(name)
        if handler is not None:
            _check_parts(handler)


def _check_parts(handler) -> None:
    stock = handler._resolve_model

    def _resolve_model(body: dict):
        resolved = stock(body)
        if _on_hf_paged(resolved[1]):
            problem = media_part(body)
            if problem is not None:
                raise RefusedRequest(f"{problem}: {body['model']} is served by hf_paged as a "
                                     "text model; image, video and audio inputs are not served")
        return resolved

    handler._resolve_model = _resolve_model


def _on_hf_paged(model) -> bool:
    from hf_paged.integrations.causal_lm import PagedCausalLM
    from hf_paged.integrations.remote_manager import RemoteModel

    return isinstance(model, (PagedCausalLM, RemoteModel))


def media_part(body: dict) -> str | None:
    """The first content part of a request's messages (chat completions' ``messages``, the
    Responses API's ``input``) that is not text, named (``messages[0].content[1] is a
    part of type 'image_url'``); None when there is none."""
    for field in ("messages", "input"):
        items = body.get(field)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in TEXT_PARTS:
                    return f"{field}[{i}].content[{j}] is a part of type {kind!r}"
    return None
