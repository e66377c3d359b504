"""peft's adapters on the drop-in model, served by the engine.

peft (``PeftModel.from_pretrained``, ``get_peft_model``, transformers' ``load_adapter``) wraps
the projections it targets in its own layers (``peft_parts`` gives it q/k/v and gate/up to
wrap) and keeps each adapter's ``lora_A`` / ``lora_B`` / ``scaling`` there, with the state of
its API: the active adapter (``set_adapter``), ``disable_adapter()``, merged adapters,
``adapter_names`` per row (a forward hook it registers for the call). The step never calls
those layers. Before each generate or forward, ``sync`` reads them: an adapter whose tensors
changed (or is new) is loaded into the engine under its name, one peft no longer holds is
unloaded, merged weights written through a part's view are put back, and the call learns
which adapter each row runs on. What the engine does not serve (DoRA, embedding adapters,
LoRA biases, an adapter on another module, several adapters active at once) is refused by
name.
"""

from __future__ import annotations

import re
import sys

from torch import nn

from hf_paged.integrations import peft_parts
from hf_paged.lora.adapter import PROJECTIONS, LoraAdapter, LoraWeight

_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def sync(model: nn.Module, engine) -> list[str | None] | None:
    """Bring the engine's adapters in line with peft's layers in ``model``; return the
    adapter of each row (peft's ``adapter_names`` for this call, else its active adapter for
    every row, a one-element list) or None when no adapter applies."""
    if "peft" not in sys.modules:  # peft was never imported: no adapter anywhere
        return None
    from peft.tuners.lora import LoraLayer

    for part in peft_parts.parts(model):
        if not part.shares_memory():
            part.write_back()
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    sources = engine.adapters.sources  # name -> the tensors' identities and versions
    adapters = _adapters(layers)
    for name in [n for n in sources if n not in adapters]:
        engine.remove_lora(name)
    for name, weights in adapters.items():
        fingerprint = tuple((id(w.a), w.a._version, id(w.b), w.b._version, w.scaling)
                            for w in weights.values())
        if sources.get(name) != fingerprint:
            if name in sources:
                engine.remove_lora(name)
            engine.add_lora(name, LoraAdapter(name, weights))
            sources[name] = fingerprint
    return _selection(layers, adapters) if layers else None


def _adapters(layers: list[tuple[str, nn.Module]]) -> dict[str, dict]:
    """Each unmerged adapter's weights, by (layer, projection), after the refusals."""
    adapters: dict[str, dict] = {}
    for path, layer in layers:
        where = _PATH.search(path)
        base = layer.get_base_layer()
        if where is None or where[2] not in PROJECTIONS or not isinstance(base, nn.Linear):
            raise ValueError(f"LoRA on {path} is not supported: hf_paged serves adapters on "
                             f"the decoder layers' {', '.join(PROJECTIONS)} (not on MoE "
                             f"experts or routers)")
        if layer.lora_embedding_A:
            raise ValueError(f"LoRA on {path}: embedding adapters are not supported")
        for name in layer.lora_A:
            if layer.use_dora.get(name):
                raise ValueError(f"adapter {name!r} uses DoRA (use_dora=True), which hf_paged "
                                 "does not serve")
            if getattr(layer, "lora_bias", {}).get(name):
                raise ValueError(f"adapter {name!r} has LoRA biases (lora_bias=True), which "
                                 "hf_paged does not serve")
            if name in layer.merged_adapters:  # already in the weights
                continue
            adapters.setdefault(name, {})[int(where[1]), where[2]] = LoraWeight(
                layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(),
                float(layer.scaling[name]))
    return adapters


def _selection(layers: list[tuple[str, nn.Module]], adapters: dict) -> list[str | None] | None:
    """The adapter of each row: peft's ``adapter_names`` hook for this call, else its one
    active adapter (none while disabled, or merged)."""
    first = layers[0][1]
    for hook in first._forward_pre_hooks.values():
        names = getattr(hook, "keywords", {}).get("adapter_names")
        if names is not None:
            return [None if n == "__base__" else n for n in names]
    if first.disable_adapters:
        return None
    active = [name for name in first.active_adapters if name in adapters]
    if len(active) > 1:
        raise ValueError(f"several active adapters at once ({', '.join(active)}) are not "
                         "supported: activate one, or combine them (add_weighted_adapter)")
    return active or None
