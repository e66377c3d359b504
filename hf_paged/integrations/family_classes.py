"""transformers' classes of a model family with hf_paged's methods in front.

Each is built once, on first use: a subclass of (an hf_paged mixin, transformers' class), so
``isinstance`` checks against transformers' class hold and everything the mixin leaves alone is
transformers' own. It keeps transformers' class name, which pipelines and scripts check models
by, and is a global of the module that builds it, under that name, where its ``__module__``
and ``__qualname__`` say it is: pickle and ``repr`` find it there.
"""

from __future__ import annotations

import sys

import transformers

from hf_paged import families


def family_class(mixin: type, transformers_name: str, module: str) -> type:
    """``transformers.<transformers_name>`` with ``mixin`` in front, a global of ``module``."""
    namespace = vars(sys.modules[module])
    built = namespace.get(transformers_name)
    if built is None:
        cls = type(transformers_name, (mixin, getattr(transformers, transformers_name)), {
            "__module__": module, "__qualname__": transformers_name, "__doc__": mixin.__doc__})
        built = namespace.setdefault(transformers_name, cls)  # one class, were two threads racing
    return built


def class_by_name(mixin: type, name: str, module: str, role: str) -> type:
    """The class named ``name`` of the family whose ``role`` (``"ARCHITECTURE"``,
    ``"INNER_MODEL"``) it is, built on first use: a module's ``__getattr__`` for families whose
    class nobody has asked for yet (``hf_paged.Qwen3ForCausalLM``, pickle's lookups)."""
    if name.startswith("__"):  # no class; asked by every ``from MODULE import NAME`` (__path__)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    for family in families.all_families():
        if getattr(family, role) == name:
            return family_class(mixin, name, module)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
