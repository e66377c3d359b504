"""patch_transformers(): transformers' loaders return hf_paged models for Qwen3 checkpoints,
stock ones (with a warning) for anything else, and everything is restored afterwards."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import transformers

import hf_paged
from tests.integrations.conftest import SMALL

IDS = torch.tensor([[5, 60, 7, 80, 9]])


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> str:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _own_loaders():
    return [vars(getattr(transformers, n)).get("from_pretrained") for n in
            ("AutoModelForCausalLM", "Qwen3ForCausalLM")]


def test_patched_loaders_serve_qwen3(tiny_checkpoint, stock_model):
    before = _own_loaders()
    with hf_paged.patch_transformers():
        for loader in (transformers.AutoModelForCausalLM, transformers.Qwen3ForCausalLM):
            model = loader.from_pretrained(tiny_checkpoint, dtype="auto", **SMALL)
            assert isinstance(model, hf_paged.Qwen3ForCausalLM)
            assert torch.equal(model.generate(IDS, max_new_tokens=5),
                               stock_model.generate(IDS, max_new_tokens=5))
            model.close()
    assert _own_loaders() == before
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint)) is (
        transformers.Qwen3ForCausalLM)


def test_patch_twice_then_unpatch(tiny_checkpoint):
    before = _own_loaders()
    handle = hf_paged.patch_transformers()
    hf_paged.patch_transformers()
    assert _own_loaders() != before
    hf_paged.unpatch_transformers()
    assert _own_loaders() == before
    handle.unpatch()  # nothing left to undo
    assert _own_loaders() == before


def test_other_architectures_load_stock_with_a_warning(llama_checkpoint):
    with hf_paged.patch_transformers():
        with pytest.warns(UserWarning, match="llama.*stock transformers") as caught:
            model = transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model) is transformers.LlamaForCausalLM
    assert len([w for w in caught if "hf_paged" in str(w.message)]) == 1


def test_the_import_swap_refuses_other_architectures(llama_checkpoint):
    """``from hf_paged import AutoModelForCausalLM`` serves hf_paged's families only: another
    architecture is refused by its model_type, not handed to stock (the patch does that)."""
    with pytest.raises(ValueError, match="this checkpoint has model_type 'llama'$"):
        hf_paged.AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_a_config_object_and_overrides_load_on_hf_paged(tiny_checkpoint, stock_model):
    """transformers applies a config object and config keywords; so does the patched loader."""
    config = transformers.AutoConfig.from_pretrained(tiny_checkpoint)
    config.return_dict = False
    with hf_paged.patch_transformers():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint, config=config, max_model_len=128, num_kv_blocks=64, block_size=8)
        assert isinstance(model, hf_paged.Qwen3ForCausalLM) and model.config is not config
        assert isinstance(model(torch.tensor([[5, 6, 7]])), tuple)
        model.close()
        model = transformers.Qwen3ForCausalLM.from_pretrained(
            tiny_checkpoint, return_dict=False, max_model_len=128, num_kv_blocks=64, block_size=8)
        assert isinstance(model(torch.tensor([[5, 6, 7]])), tuple)
        model.close()


def test_subclasses_load_stock_without_a_warning(tiny_checkpoint):
    class Custom(transformers.Qwen3ForCausalLM):
        pass

    with hf_paged.patch_transformers(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert type(Custom.from_pretrained(tiny_checkpoint)) is Custom


def test_pipeline_from_a_path_under_the_patch(tiny_checkpoint):
    prompts = ["The river starts", "Hello! How are you today? I am fine"]
    stock = transformers.pipeline("text-generation", model=tiny_checkpoint)
    expected = stock(prompts, max_new_tokens=6, do_sample=False, batch_size=2)
    with hf_paged.patch_transformers():
        paged = transformers.pipeline("text-generation", model=tiny_checkpoint)
        assert isinstance(paged.model, hf_paged.Qwen3ForCausalLM)
        assert paged(prompts, max_new_tokens=6, do_sample=False, batch_size=2) == expected
        paged.model.close()


def test_a_quantization_hf_paged_refuses_loads_stock_with_a_warning(fp8_checkpoints, tmp_path):
    """No weight_block_size: hf_paged refuses (per-tensor FP8 is not served), transformers
    assumes 128x128 blocks; under the patch the script runs on stock transformers."""
    path = shutil.copytree(fp8_checkpoints["one_block_tied"], tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (path / "config.json").write_text(json.dumps(config))
    with hf_paged.patch_transformers():
        with pytest.warns(UserWarning, match="weight_block_size=None is not served.*loads "
                                             "with stock transformers"):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
        assert type(model) is transformers.Qwen3ForCausalLM
        served = transformers.AutoModelForCausalLM.from_pretrained(
            fp8_checkpoints["one_block_tied"], dtype=torch.float32, **SMALL)
        assert isinstance(served, hf_paged.Qwen3ForCausalLM)
        assert torch.equal(served.generate(IDS, max_new_tokens=5),
                           model.generate(IDS, max_new_tokens=5))
        served.close()
