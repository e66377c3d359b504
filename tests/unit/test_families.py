"""The model-family registry: a checkpoint's model_type picks its family module, others are
refused naming what is supported; each family's drop-in classes are transformers' own (name,
subclass, pickling); and a second family, once registered, is served by the patch and by
``AutoModelForCausalLM`` with its own classes."""

from __future__ import annotations

import copy
import pickle
import sys
import types

import pytest
import torch
import transformers
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

import hf_paged
from hf_paged import families
from hf_paged.families import qwen3, qwen3_moe
from hf_paged.integrations import causal_lm, model_call
from hf_paged.integrations.causal_lm import PagedCausalLM, causal_lm_class
from hf_paged.integrations.model_call import PagedInnerModel, inner_model_class
from tests.conftest import TINY_CONFIGS

QWEN3 = ("Qwen3 checkpoints (model_type 'qwen3', Qwen3ForCausalLM) and Qwen3-MoE checkpoints "
         "(model_type 'qwen3_moe', Qwen3MoeForCausalLM) and Qwen3-Next checkpoints (model_type "
         "'qwen3_next', Qwen3NextForCausalLM) and Qwen3.5 checkpoints (model_type "
         "'qwen3_5_text', Qwen3_5ForCausalLM) and Qwen3.5-MoE checkpoints (model_type "
         "'qwen3_5_moe_text', Qwen3_5MoeForCausalLM)")
SERVED = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# What a family module provides (see families/qwen3.py).
FAMILY_INTERFACE = ("NAME", "MODEL_TYPES", "ARCHITECTURE", "INNER_MODEL", "OUTPUT",
                    "PACKED_MODULES",
                    "packed_sizes", "checkpoint_keys", "weight_target", "check_config",
                    "check_shardable", "swap_modules")
TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_a_qwen3_config_picks_the_qwen3_family():
    assert families.family_for(Qwen3Config()) is qwen3
    assert families.family_for("qwen3") is qwen3
    assert families.supported_model_types() == SERVED
    assert families.family_for(Qwen3MoeConfig()) is qwen3_moe
    families.check_model(Qwen3Config(**TINY_CONFIGS["gqa_tied"]), 2)


def test_an_unknown_model_type_is_refused_naming_it():
    message = f"hf_paged supports {QWEN3}; this checkpoint has model_type 'llama'"
    with pytest.raises(ValueError) as raised:
        families.family_for(LlamaConfig())
    assert str(raised.value) == message
    with pytest.raises(ValueError, match="model_type 'llama'"):
        families.check_model(LlamaConfig(), 1)


@pytest.mark.parametrize("override, match", [
    (dict(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2),
     "sliding-window attention"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_a_config_the_modules_cannot_run_is_refused(override, match):
    with pytest.raises(ValueError, match=match):
        families.check_model(Qwen3Config(**{**TINY_CONFIGS["gqa_tied"], **override}), 1)


@pytest.mark.parametrize("model_type", families.supported_model_types())
def test_every_registered_family_claims_its_model_types(model_type):
    family = families.family_for(model_type)
    assert model_type in family.MODEL_TYPES
    for name in FAMILY_INTERFACE:
        assert hasattr(family, name), name
    assert issubclass(getattr(transformers, family.ARCHITECTURE), transformers.PreTrainedModel)
    assert issubclass(getattr(transformers, family.INNER_MODEL), transformers.PreTrainedModel)
    config = transformers.AutoConfig.for_model(model_type)
    # a key may name the merged module's parent too ("shared_expert.gate_up_proj")
    assert {key.rpartition(".")[2] for key in family.packed_sizes(config)} <= {
        m for m, _ in family.PACKED_MODULES.values()}


def test_the_drop_in_classes_are_transformers_own():
    cls = hf_paged.Qwen3ForCausalLM
    assert cls is causal_lm_class(qwen3) is causal_lm.Qwen3ForCausalLM  # built once
    assert issubclass(cls, transformers.Qwen3ForCausalLM) and issubclass(cls, PagedCausalLM)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (
        "Qwen3ForCausalLM", "Qwen3ForCausalLM", "hf_paged.integrations.causal_lm")
    inner = inner_model_class(qwen3)
    assert inner is model_call.Qwen3Model
    assert issubclass(inner, transformers.Qwen3Model) and issubclass(inner, PagedInnerModel)
    assert (inner.__name__, inner.__module__) == ("Qwen3Model", "hf_paged.integrations.model_call")
    for built in (cls, inner):
        assert pickle.loads(pickle.dumps(built)) is built


def test_copying_behaves_as_before():
    """A shallow copy is transformers' own; a deep copy is refused (an engine is not copied)."""
    with torch.device("meta"):
        model = hf_paged.Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIGS["gqa_tied"]))
    assert type(copy.copy(model)) is hf_paged.Qwen3ForCausalLM
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(model)


# ---- a second family, registered for the test -------------------------------------------

@pytest.fixture
def llama_family(monkeypatch):
    """Llama registered as a family (its modules are never built here)."""
    family = types.ModuleType("tests.unit.llama_family")
    family.NAME, family.MODEL_TYPES = "Llama", ("llama",)
    family.ARCHITECTURE, family.INNER_MODEL = "LlamaForCausalLM", "LlamaModel"
    family.OUTPUT = "CausalLMOutputWithPast"
    monkeypatch.setitem(sys.modules, family.__name__, family)
    monkeypatch.setitem(families.REGISTRY, "llama", family.__name__)
    yield family
    vars(causal_lm).pop("LlamaForCausalLM", None)
    vars(model_call).pop("LlamaModel", None)


def test_the_registry_imports_a_family_only_when_asked(monkeypatch):
    monkeypatch.setitem(families.REGISTRY, "llama", "tests.unit.no_such_family")
    assert families.supported_model_types() == (*SERVED, "llama")
    assert families.family_for("qwen3") is qwen3
    with pytest.raises(ModuleNotFoundError):
        families.family_for("llama")


def test_a_second_family_is_claimed_and_named(llama_family):
    assert families.family_for(LlamaConfig()) is llama_family
    with pytest.raises(ValueError) as raised:
        families.family_for("mistral")
    assert str(raised.value) == (
        f"hf_paged supports {QWEN3} and Llama checkpoints (model_type 'llama', "
        "LlamaForCausalLM); this checkpoint has model_type 'mistral'")
    cls = causal_lm_class(llama_family)
    assert cls is causal_lm.LlamaForCausalLM and cls.__name__ == "LlamaForCausalLM"
    assert issubclass(cls, transformers.LlamaForCausalLM) and issubclass(cls, PagedCausalLM)
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_the_patch_serves_every_family(llama_family, monkeypatch):
    served = []

    class Served:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            served.append(path)
            return "hf_paged model"

    monkeypatch.setattr("hf_paged.integrations.patch.AutoModelForCausalLM", Served)
    config = LlamaConfig(**TINY_LLAMA)
    with hf_paged.patch_transformers():
        for loader in (transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM):
            assert loader.from_pretrained("acme/tiny-llama", config=config) == "hf_paged model"
    assert served == ["acme/tiny-llama"] * 2
    assert "from_pretrained" not in vars(transformers.LlamaForCausalLM)


class _Engine:
    """What ``from_engine`` reads of an engine: its config and its swapped model."""

    def __init__(self, config):
        self.hf_config = config
        with torch.device("meta"):
            self.model = types.SimpleNamespace(hf_model=transformers.LlamaForCausalLM(config))


def test_auto_model_picks_the_drop_in_class_of_the_engines_family(llama_family, monkeypatch):
    engine = _Engine(LlamaConfig(**TINY_LLAMA))
    monkeypatch.setattr(causal_lm, "load_engine", lambda path, kwargs: engine)
    model = hf_paged.AutoModelForCausalLM.from_pretrained("acme/tiny-llama")
    assert type(model) is causal_lm.LlamaForCausalLM
    assert isinstance(model, transformers.LlamaForCausalLM) and model.engine is engine
    assert type(model.model) is model_call.LlamaModel
    assert isinstance(model.model, transformers.LlamaModel)
    assert model.model.engine_ref() is engine and model.model is engine.model.hf_model.model
