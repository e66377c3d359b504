"""peft's API on the drop-in model, unchanged, against the same calls on stock transformers
(float32, CPU, padded batches): ``PeftModel.from_pretrained``, ``load_adapter``,
``set_adapter``, ``disable_adapter()``, ``adapter_names`` per row, the forward, ``unload``,
``merge_and_unload``, ``delete_adapter``, ``get_peft_model``, ``AutoModelForCausalLM`` on an
adapter's folder, transformers' own adapter methods; and what is not served refused by name."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_paged
from tests.conftest import FLOAT32_RTOL, left_padded
from tests.lora_adapters import ADAPTERS, save_adapter

BASE = "gqa4_untied"
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("peft_api")
    return {name: save_adapter(checkpoints[BASE], str(folder / name), seed, **lora)
            for seed, (name, lora) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def batch():
    return left_padded([6, 13, 9], 1024, seed=8)


def models(checkpoint: str):
    """Stock transformers and the drop-in model on ``checkpoint``."""
    return (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
            hf_paged.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                          device_map="cpu"))


def tokens(model, batch, **kwargs) -> torch.Tensor:
    ids, mask = batch
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                          do_sample=False, **kwargs)


def same(stock, ours, batch, **kwargs) -> None:
    assert torch.equal(tokens(ours, batch, **kwargs), tokens(stock, batch, **kwargs))


def test_peft_model_api(checkpoints, adapters, batch):
    stock, ours = (PeftModel.from_pretrained(m, adapters["qv"], adapter_name="qv")
                   for m in models(checkpoints[BASE]))
    for model in (stock, ours):
        model.load_adapter(adapters["all"], adapter_name="all")
    same(stock, ours, batch)  # the first adapter is active
    for model in (stock, ours):
        model.set_adapter("all")
    same(stock, ours, batch)
    with stock.disable_adapter(), ours.disable_adapter():
        same(stock, ours, batch)
    same(stock, ours, batch, adapter_names=["all", "__base__", "qv"])
    ids, mask = batch
    keep = mask.bool()
    expected = stock(input_ids=ids, attention_mask=mask).logits[keep]
    # another summation order through every layer, over hidden states the scaled-up adapters
    # make much larger than the logits: hundreds of float32 steps of the largest logit
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[keep], expected,
                               rtol=FLOAT32_RTOL, atol=512 * EPS * float(expected.abs().max()))
    for model in (stock, ours):
        model.delete_adapter("qv")
    same(stock, ours, batch)
    stock, ours = stock.merge_and_unload(), ours.merge_and_unload()
    same(stock, ours, batch)  # "all" merged into the weights


def test_unload_and_get_peft_model(checkpoints, adapters, batch):
    stock, ours = (PeftModel.from_pretrained(m, adapters["all"]).unload()
                   for m in models(checkpoints[BASE]))
    same(stock, ours, batch)  # the base model again
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                        init_lora_weights=False)
    stock, ours = get_peft_model(stock, config), get_peft_model(ours, config)
    # peft draws each model's weights in its module order: give ours stock's
    set_peft_model_state_dict(ours, get_peft_model_state_dict(stock))
    same(stock, ours, batch)


def test_adapter_folder_and_load_adapter(checkpoints, adapters, batch):
    stock = AutoModelForCausalLM.from_pretrained(adapters["attn"], dtype=torch.float32)
    ours = hf_paged.AutoModelForCausalLM.from_pretrained(adapters["attn"], dtype=torch.float32,
                                                         device_map="cpu")
    same(stock, ours, batch)
    stock, ours = models(checkpoints[BASE])
    for model in (stock, ours):
        model.load_adapter(adapters["all"], adapter_name="all")
    same(stock, ours, batch)


@pytest.mark.parametrize("method", ["set_adapter", "disable_adapters", "enable_adapters",
                                    "active_adapters"])
def test_transformers_adapter_methods_as_stock(checkpoints, adapters, batch, method):
    """transformers' own methods on a model with adapters: what stock does (they may refuse
    the installed peft), hf_paged does."""
    results = []
    for model in models(checkpoints[BASE]):
        model.load_adapter(adapters["qv"], adapter_name="qv")
        args = ("qv",) if method == "set_adapter" else ()
        try:
            getattr(model, method)(*args)
            results.append(tokens(model, batch))
        except Exception as error:  # noqa: BLE001  (the same refusal is the expected result)
            results.append(f"{type(error).__name__}: {error}")
    if isinstance(results[0], str):
        assert results[1] == results[0]
    else:
        assert torch.equal(results[1], results[0])


@pytest.mark.parametrize("lora,refused", [
    (dict(use_dora=True), "DoRA"),
    (dict(target_modules=["qkv_proj"]), "qkv_proj is not supported"),
], ids=["dora", "merged_module"])
def test_unserved_adapters_refused_by_name(checkpoints, batch, lora, refused):
    _, ours = models(checkpoints[BASE])
    config = dict(r=4, target_modules=["q_proj"], init_lora_weights=False) | lora
    model = get_peft_model(ours, LoraConfig(**config))
    with pytest.raises(ValueError, match=refused):
        tokens(model, batch)
    with pytest.raises(ValueError, match=refused):
        model(input_ids=batch[0])


def test_several_active_adapters_refused(checkpoints, adapters, batch):
    _, ours = models(checkpoints[BASE])
    model = PeftModel.from_pretrained(ours, adapters["qv"], adapter_name="qv")
    model.load_adapter(adapters["attn"], adapter_name="attn")
    model.base_model.set_adapter(["qv", "attn"])
    with pytest.raises(ValueError, match="several active adapters at once"):
        tokens(model, batch)
    model.set_adapter("attn")  # one again: served
    tokens(model, batch)


def test_generate_batch_runs_on_the_active_adapter(checkpoints, adapters):
    """transformers' continuous batching on the drop-in model under peft: each request runs
    on the adapter active when the manager is made, as generate() would run it."""
    stock, ours = (PeftModel.from_pretrained(m, adapters["all"], adapter_name="all")
                   for m in models(checkpoints[BASE]))
    prompts = [[5, 9, 300, 41], [7, 77, 777, 12, 600, 3]]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    out = ours.generate_batch(prompts, generation_config=greedy)
    moved = False
    for prompt, result in zip(prompts, out.values()):
        want = stock.generate(input_ids=torch.tensor([prompt]), generation_config=greedy)
        assert result.generated_tokens == want[0, len(prompt):].tolist()
        with stock.disable_adapter():
            base = stock.generate(input_ids=torch.tensor([prompt]), generation_config=greedy)
        moved |= not torch.equal(base, want)
    assert moved  # the adapter changes the tokens: the base model's would not pass
