"""``patch_transformers()``: transformers' ``from_pretrained`` returns hf_paged models for the
checkpoints hf_paged supports (``hf_paged.families``, unquantized or of a quantization
``hf_paged.quantization`` serves), so existing scripts run on the engine unchanged."""

from __future__ import annotations

import inspect
import warnings

import transformers
from transformers import AutoConfig, PretrainedConfig

from hf_paged import families, quantization
from hf_paged.config import EngineConfig
from hf_paged.families.vision_language import FP8_RELEASE_REFUSAL, causal_lm_config
from hf_paged.integrations.causal_lm import AutoModelForCausalLM

# Keywords that help read a checkpoint's config.json from the hub.
_CONFIG_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only", "force_download",
                    "proxies")
_ABSENT = object()
# class -> the ``from_pretrained`` entry of its own ``__dict__`` before patching (or _ABSENT).
_saved: dict[type, object] = {}
# Engine options of the latest patch_transformers() call: defaults for every hf_paged load under
# the patch, for callers that cannot pass them (a server's own loader, an unchanged script).
_engine_defaults: dict[str, object] = {}


def engine_defaults() -> dict[str, object]:
    """The engine options of the latest ``patch_transformers()`` call (a copy)."""
    return dict(_engine_defaults)


class TransformersPatch:
    """What ``patch_transformers()`` returns; as a context manager it unpatches on exit."""

    def __enter__(self) -> TransformersPatch:
        return self

    def __exit__(self, *exc_info) -> None:
        unpatch_transformers()

    def unpatch(self) -> None:
        unpatch_transformers()


def patch_transformers(**engine_options: object) -> TransformersPatch:
    """Make ``transformers.AutoModelForCausalLM.from_pretrained`` and the ``from_pretrained`` of
    every supported family's class (``transformers.Qwen3ForCausalLM``, ...) return hf_paged's
    drop-in class for the checkpoints hf_paged supports (``hf_paged.Qwen3ForCausalLM``, ...);
    other checkpoints load with stock transformers, with a warning.
    ``engine_options`` (``EngineConfig`` fields, e.g. ``max_model_len=4096``) are defaults for
    every hf_paged load under the patch; a ``from_pretrained`` call's own keywords win. Patching
    twice is the same as once, with the second call's engine options."""
    EngineConfig.from_options(**engine_options)  # unknown names and bad values raise here
    _engine_defaults.clear()
    _engine_defaults.update(engine_options)
    for name in patched_names():
        patch_loader(getattr(transformers, name))
    return TransformersPatch()


def patch_loader(cls: type) -> None:
    """Make ``cls.from_pretrained`` return hf_paged's drop-in class for the checkpoints hf_paged
    supports and hand the rest to its own (``unpatch_transformers`` gives it back)."""
    if cls in _saved:
        return
    _saved[cls] = cls.__dict__.get("from_pretrained", _ABSENT)
    stock = inspect.getattr_static(cls, "from_pretrained")  # the classmethod, maybe inherited
    cls.from_pretrained = classmethod(_loader(cls, stock))


def patched_names() -> tuple[str, ...]:
    """The loaders a script calls for a causal LM hf_paged serves, by their names in
    ``transformers``."""
    return ("AutoModelForCausalLM", *(family.ARCHITECTURE for family in families.all_families()))


def unpatch_transformers() -> None:
    """Give transformers back its own ``from_pretrained``."""
    _engine_defaults.clear()
    for cls in list(_saved):
        unpatch_loader(cls)


def unpatch_loader(cls: type) -> None:
    """Give ``cls`` back its own ``from_pretrained`` (nothing when it is not patched)."""
    original = _saved.pop(cls, None)
    if original is _ABSENT:
        del cls.from_pretrained
    elif original is not None:
        cls.from_pretrained = original


def _loader(patched_cls: type, stock):
    """A ``from_pretrained`` that serves supported checkpoints with hf_paged and hands the rest
    (and subclasses of the patched class) to ``stock``, the original classmethod."""

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if cls is patched_cls:
            release = _config(pretrained_model_name_or_path, kwargs)
            config = causal_lm_config(release) if release is not None else None
            model_type = getattr(config, "model_type", None)
            supported = model_type in families.supported_model_types()
            refused = supported and quantization_refused(config, kwargs, config is not release)
            if supported and not model_args and not refused:
                return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path,
                                                            **{**_engine_defaults, **kwargs})
            if model_type is not None:
                why = refused or ("hf_paged takes no positional model_args" if supported else
                                  f"hf_paged serves {families.supported_description()} only")
                warnings.warn(f"{why}; {pretrained_model_name_or_path!r} (model_type "
                              f"{model_type!r}) loads with stock transformers", stacklevel=2)
        return stock.__get__(None, cls)(pretrained_model_name_or_path, *model_args, **kwargs)

    from_pretrained.__doc__ = (f"{patched_cls.__name__}.from_pretrained, patched by hf_paged: "
                               "supported checkpoints load on hf_paged's engine.")
    return from_pretrained


def _config(path_or_id, kwargs: dict) -> PretrainedConfig | None:
    """The config passed (an object or a path) or else the checkpoint's, or None when it
    cannot be read (stock transformers then reports why)."""
    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        return config
    hub = {name: kwargs[name] for name in _CONFIG_KEYWORDS if name in kwargs}
    try:
        return AutoConfig.from_pretrained(config or path_or_id, **hub)
    except (OSError, ValueError, KeyError):
        return None


def quantization_refused(config: PretrainedConfig, kwargs: dict, release: bool = False
                         ) -> str | None:
    """Why hf_paged would refuse the checkpoint's (or the passed) quantization_config, which
    stock transformers may load; None when it serves it. ``release``: ``config`` is a
    vision-language release's text config (``causal_lm_config``), whose own FP8 weights
    hf_paged refuses."""
    try:
        scheme = quantization.resolve(config, kwargs.get("quantization_config"))
    except ValueError as error:
        return str(error)
    if release and scheme is not None and scheme.pre_quantized:
        return FP8_RELEASE_REFUSAL
    return None
