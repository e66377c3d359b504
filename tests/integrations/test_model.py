"""hf_paged.AutoModelForCausalLM: transformers' loading keywords, the attributes scripts read,
a forward equal to transformers', inference-only guards and the lifecycle."""

from __future__ import annotations

import copy
import gc
import os
import shutil

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import FLOAT32_RTOL
from tests.integrations.conftest import SMALL

IDS = torch.tensor([[5, 60, 7, 80, 9, 10, 11]])


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)


@pytest.mark.parametrize("kwargs", [
    dict(dtype="auto"),
    dict(torch_dtype=torch.float32, device_map="cpu"),
    dict(dtype="float32", device_map={"": "cpu"}),
    dict(device_map="auto", attn_implementation="sdpa", low_cpu_mem_usage=True,
         trust_remote_code=False, revision="main", token=None, local_files_only=True),
    # what pipeline("text-generation", model=path) passes
    dict(_from_pipeline="text-generation", revision=None, token=None, trust_remote_code=None,
         local_files_only=False, code_revision=None, dtype="auto"),
    dict(quantization_config=None, variant=None, state_dict=None, use_kernels=False),
])
def test_transformers_loading_keywords(tiny_checkpoint, stock_model, kwargs):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **kwargs, **SMALL)
    assert model.dtype == torch.float32
    on_gpu = torch.cuda.is_available() and kwargs.get("device_map") in (None, "auto")
    assert model.device.type == ("cuda" if on_gpu else "cpu")
    assert torch.equal(model.generate(IDS, max_new_tokens=6),
                       stock_model.generate(IDS, max_new_tokens=6))


def test_dtype_names_the_weights(tiny_checkpoint):
    for dtype in (torch.bfloat16, "bfloat16"):
        model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=dtype,
                                                              device_map="cpu", **SMALL)
        assert model.dtype == torch.bfloat16
        assert model(IDS).logits.dtype == torch.bfloat16


def test_what_scripts_read(model, stock_model, tiny_checkpoint):
    assert model.config.to_dict() == stock_model.config.to_dict()
    assert model.generation_config.to_dict() == stock_model.generation_config.to_dict()
    assert model.name_or_path == tiny_checkpoint
    assert model.can_generate()
    assert model.config.eos_token_id == 2
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.get_input_embeddings().weight.shape == (1024, 64)
    for exclude in (False, True):
        assert model.num_parameters(exclude_embeddings=exclude) == stock_model.num_parameters(
            exclude_embeddings=exclude)
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names


def test_generation_config_edits_reach_generate(tiny_checkpoint, stock_model):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)
    model.generation_config.max_new_tokens = 3
    assert model.generate(IDS).shape[1] == IDS.shape[1] + 3


def test_harmless_and_refused_moves(model):
    assert model.eval() is model and model.train(False) is model and not model.training
    assert model.requires_grad_(False) is model
    for same in (model.to("cpu"), model.to(torch.float32), model.to("cpu", torch.float32),
                 model.cpu(), model.float()):
        assert same is model
    with pytest.raises(ValueError, match="to\\(\\).*meta"):
        model.to("meta")
    with pytest.raises(ValueError, match="float16"):
        model.half()
    with pytest.raises(RuntimeError, match="inference only"):
        model.train()
    with pytest.raises(RuntimeError, match="inference only"):
        model.requires_grad_(True)
    assert not model.training


@pytest.mark.parametrize("kwargs, match", [
    (dict(trust_remote_code=True), "trust_remote_code"),
    (dict(device_map={"model": 0, "lm_head": "cpu"}), "tensor parallelism"),
    (dict(device_map="disk"), "device_map"),
    (dict(use_safetensors=False), "use_safetensors"),
    (dict(dtype="int8"), "dtype"),
    (dict(device_map="cpu", device="cpu"), "device_map or device"),
    (dict(quantization_config={"load_in_8bit": True}), "quantization_config"),
    (dict(config=object()), "config"),
])
def test_refused_keywords(tiny_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **kwargs, **SMALL)


def test_subfolder_and_generation_config(tiny_checkpoint, stock_model, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path / "inner")
    config = transformers.GenerationConfig(max_new_tokens=3, eos_token_id=2, pad_token_id=0)
    model = hf_paged.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), subfolder="inner", generation_config=config, **SMALL)
    assert model.generation_config is config
    assert torch.equal(model.generate(IDS), stock_model.generate(IDS, max_new_tokens=3))


def test_unknown_keyword_is_named(tiny_checkpoint):
    with pytest.raises(TypeError, match="output_scores_please.*device_map"):
        hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, output_scores_please=1)


def test_cuda_device_map(tiny_checkpoint):
    """On a machine without CUDA, asking for it says so; with CUDA the model goes there."""
    if torch.cuda.is_available():
        model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, device_map=0,
                                                              **SMALL)
        assert model.device == torch.device("cuda", 0)
        assert model.to("cuda") is model
        model.close()
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, device_map="cuda:0")


def test_hub_id_from_the_cache(tiny_checkpoint, stock_model, tmp_path):
    """A hub id resolves through huggingface_hub with transformers' keywords (here from a
    local cache, as on a machine with a hub after a first download)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny-qwen3"
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = dict(cache_dir=str(tmp_path), local_files_only=True, revision="main")
    model = hf_paged.AutoModelForCausalLM.from_pretrained("acme/tiny-qwen3", **hub, **SMALL)
    assert model.config._name_or_path == "acme/tiny-qwen3"
    assert torch.equal(model.generate(IDS, max_new_tokens=4),
                       stock_model.generate(IDS, max_new_tokens=4))
    with pytest.raises(OSError, match="acme/absent"):
        hf_paged.AutoModelForCausalLM.from_pretrained("acme/absent", **hub)


def _batch(kind: str):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1024, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    if kind == "left":
        mask[0, :4], mask[1, :9] = 0, 0
    elif kind == "right":
        mask[0, 7:], mask[2, 2:] = 0, 0
    elif kind == "holes":
        mask[0, 3], mask[1, 0], mask[1, 5:7] = 0, 0, 0
    elif kind == "empty_row":
        mask[1], mask[2, :5] = 0, 0
    return ids, mask


@pytest.mark.parametrize("kind", ["none", "left", "right", "holes", "empty_row"])
def test_forward_logits_equal_transformers(model, stock_model, kind):
    ids, mask = _batch(kind)
    out = model(ids, attention_mask=mask)
    ref = stock_model(ids, attention_mask=mask)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    # Positions the mask drops too: a left-padded loss reads the last padding position.
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=FLOAT32_RTOL)
    # a past, as transformers returns with the config's use_cache (tests/integrations/
    # test_past_tokens.py continues from it)
    assert out.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()


def test_forward_options_equal_transformers(model, stock_model):
    ids, mask = _batch("left")
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref = stock_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=FLOAT32_RTOL)
    positions = torch.arange(3, 3 + ids.shape[1])[None]
    torch.testing.assert_close(model(ids, position_ids=positions).logits,
                               stock_model(ids, position_ids=positions).logits,
                               atol=1e-4, rtol=FLOAT32_RTOL)
    last = model(ids, attention_mask=mask, logits_to_keep=1).logits
    torch.testing.assert_close(last, ref.logits[:, -1:], atol=1e-4, rtol=FLOAT32_RTOL)
    loss, logits, _ = model(ids, labels=ids, return_dict=False)  # the past, as transformers
    torch.testing.assert_close(loss, stock_model(ids, labels=ids).loss,
                               atol=1e-5, rtol=FLOAT32_RTOL)


def test_forward_leaves_the_engine_cache_alone(model):
    expected = model.generate(IDS, max_new_tokens=6)
    layer = model.engine.model.attention_layers[0]
    cache, before = layer.k_cache, layer.k_cache.clone()
    model(torch.randint(3, 1024, (4, 40)))
    assert layer.k_cache is cache and torch.equal(cache, before)
    assert torch.equal(model.generate(IDS, max_new_tokens=6), expected)


def test_hidden_states_survive_the_in_place_residual_add(model, stock_model, monkeypatch):
    """The GPU's fused residual add writes the sum in place of its inputs (the Triton twin of
    ``add_rms_norm``), and the first layer's residual is the embeddings themselves: the
    streams must not alias them."""
    from hf_paged import kernels
    from hf_paged.kernels import reference

    def in_place(x, residual, weight, eps, offset=False):
        normed, total = reference.add_rms_norm(x, residual, weight, eps, offset)
        residual.copy_(total)
        return x.copy_(normed), residual

    monkeypatch.setattr(kernels, "add_rms_norm", in_place)
    ids, mask = _batch("left")
    ref = stock_model(ids, attention_mask=mask, output_hidden_states=True)
    assert_streams_equal(model(ids, attention_mask=mask, output_hidden_states=True).hidden_states,
                         ref.hidden_states)


@pytest.mark.parametrize("call, match", [
    (lambda m: m(IDS.to(torch.int8)), "int8"),
    (lambda m: m(IDS.to(torch.uint8)), "uint8"),
    (lambda m: m.generate(IDS.to(torch.int8), max_new_tokens=2), "int8"),
    (lambda m: m.generate(IDS.to(torch.uint8), max_new_tokens=2), "uint8"),
    (lambda m: m(IDS[0]), "input_ids"),
    (lambda m: m(IDS, attention_mask=torch.ones(1, 3)), "attention_mask"),
    (lambda m: m(IDS, past_key_values=object()), "past_key_values"),
    (lambda m: m(IDS, past_key_values=transformers.DynamicCache()), "DynamicCache"),
    (lambda m: m(inputs_embeds=torch.zeros(1, 3, 64)), "inputs_embeds"),
    (lambda m: m(IDS, output_attentions=True), "output_attentions"),
    # What a tokenizer that adds no BOS token gives for "": stock fails in a reshape.
    (lambda m: m(IDS[:, :0]), r"^input_ids is empty \(shape \(1, 0\)\)"),
    (lambda m: m.generate(IDS[:, :0], attention_mask=IDS[:, :0]),
     r"^input_ids is empty \(shape \(1, 0\)\)"),
])
def test_bad_forward_input(model, call, match):
    with pytest.raises(ValueError, match=match):
        call(model)
    assert model(IDS).logits.shape == (1, IDS.shape[1], 1024)


def test_cache_errors_name_the_cpu_setting(tiny_checkpoint):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, max_model_len=128, num_kv_blocks=2, block_size=8, device_map="cpu")
    with pytest.raises(ValueError, match="cpu_kv_cache_gib"):
        model.generate(IDS, max_new_tokens=40)
    with pytest.raises(ValueError, match="cpu_kv_cache_gib"):
        hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, cpu_kv_cache_gib=1e-9,
                                                      device_map="cpu")


def test_close_then_load_again(tiny_checkpoint):
    with hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL) as first:
        expected = first.generate(IDS, max_new_tokens=5)
    layer = first.engine.model.attention_layers[0]
    assert layer.k_cache.numel() == 0 and first.lm_head.weight.is_meta
    for call in (lambda: first.generate(IDS, max_new_tokens=2), lambda: first(IDS)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    first.close()  # a second close does nothing
    second = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)
    assert torch.equal(second.generate(IDS, max_new_tokens=5), expected)
    del second
    gc.collect()
    third = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)
    assert torch.equal(third.generate(IDS, max_new_tokens=5), expected)


def test_checkpoint_tokenizer(tiny_checkpoint, tokenizer):
    """make-checkpoint writes a trained byte-level BPE tokenizer with a chat template."""
    assert os.path.exists(os.path.join(tiny_checkpoint, "tokenizer.json"))
    text = "Hello, how are you today? 你好"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())
    assert max(ids) < 1024
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_model_is_transformers_own_class(model, stock_model):
    """Every attribute a client reads is transformers' own, by inheritance."""
    assert isinstance(model, transformers.Qwen3ForCausalLM)
    assert isinstance(model, transformers.PreTrainedModel)
    for name in ("loss_type", "main_input_name", "base_model_prefix", "is_gradient_checkpointing",
                 "_tied_weights_keys", "supports_gradient_checkpointing"):
        assert getattr(model, name) == getattr(stock_model, name), name
    assert model.get_decoder() is model.model is model.base_model
    assert model.config is model.engine.hf_config
    assert model.generation_config is model.engine.generation_config
    model.tie_weights()  # lm-eval calls it; the engine's tied weights stay tied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [n for n, _ in model.named_children()] == [n for n, _ in stock_model.named_children()]
    inputs = model.prepare_inputs_for_generation(IDS, attention_mask=torch.ones_like(IDS))
    assert torch.equal(inputs["input_ids"], IDS)


def test_inner_model_and_embeddings_answer_as_transformers(model, stock_model):
    """Clients that call ``model.model`` (feature extraction) or the embedding module."""
    ids, mask = _batch("left")
    out = model.model(ids, attention_mask=mask)
    ref = stock_model.model(ids, attention_mask=mask)
    assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPast)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state,
                               atol=1e-4, rtol=FLOAT32_RTOL)
    assert isinstance(model.base_model(ids, return_dict=False), tuple)
    assert torch.equal(model.get_input_embeddings()(ids), stock_model.get_input_embeddings()(ids))
    assert model.model(ids, use_cache=False).past_key_values is None


def assert_streams_equal(got: tuple, want: tuple) -> None:
    """transformers' ``hidden_states``: the embeddings, each layer's input, the final ones."""
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=FLOAT32_RTOL)


@pytest.mark.parametrize("kind", ["left", "holes"])
def test_hidden_states_equal_transformers(model, stock_model, kind, monkeypatch):
    """``output_hidden_states`` (the keyword, else the config's) on the causal LM and the
    inner model, in the output and in its tuple form, and the new tokens' after a past."""
    ids, mask = _batch(kind)
    ref = stock_model(ids, attention_mask=mask, output_hidden_states=True)
    out = model(ids, attention_mask=mask, output_hidden_states=True)
    assert_streams_equal(out.hidden_states, ref.hidden_states)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=FLOAT32_RTOL)
    inner = model.model(ids, attention_mask=mask, output_hidden_states=True)
    assert_streams_equal(inner.hidden_states,
                         stock_model.model(ids, attention_mask=mask,
                                           output_hidden_states=True).hidden_states)
    assert model(ids, attention_mask=mask).hidden_states is None
    monkeypatch.setattr(model.config, "output_hidden_states", True)
    as_tuple = model(ids, attention_mask=mask, return_dict=False)
    assert_streams_equal(as_tuple[2], ref.hidden_states)  # logits, past, hidden states
    assert model(ids, attention_mask=mask, output_hidden_states=False).hidden_states is None
    monkeypatch.undo()
    past = model(ids[:, :6], attention_mask=mask[:, :6]).past_key_values
    new = model(ids[:, 6:], attention_mask=mask, past_key_values=past,
                output_hidden_states=True)
    assert_streams_equal(new.hidden_states, tuple(h[:, 6:] for h in ref.hidden_states))


@pytest.mark.parametrize("call, match", [
    (lambda m: m.gradient_checkpointing_enable(), "gradient_checkpointing_enable"),
    (lambda m: m.resize_token_embeddings(2048), "resize_token_embeddings"),
    (lambda m: m.set_input_embeddings(torch.nn.Embedding(4, 64)), "set_input_embeddings"),
    (lambda m: m.enable_input_require_grads(), "enable_input_require_grads"),
    (lambda m: copy.deepcopy(m), "deepcopy"),
])
def test_what_the_engine_cannot_do_is_named(model, call, match):
    with pytest.raises(RuntimeError, match=match):
        call(model)
    assert not model.is_gradient_checkpointing


def test_resizing_to_the_same_size_is_harmless(model):
    assert model.resize_token_embeddings(1024) is model.get_input_embeddings()
    assert model.resize_token_embeddings(1000, pad_to_multiple_of=512) is model.model.embed_tokens
    assert model.resize_token_embeddings() is model.get_input_embeddings()


def test_state_dict_and_save_pretrained_in_transformers_layout(model, stock_model, tmp_path):
    assert model.state_dict().keys() == stock_model.state_dict().keys()
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded) is transformers.Qwen3ForCausalLM
    torch.testing.assert_close(reloaded(IDS).logits, stock_model(IDS).logits, atol=0, rtol=0)


def test_config_overrides_apply_as_in_transformers(tiny_checkpoint, stock_model):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, return_dict=False,
                                                          **SMALL)
    assert model.config.return_dict is False
    assert isinstance(model(IDS), tuple)
    model.close()
    # An override the engine honours changes the numbers as it does in transformers.
    kwargs = dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    stock = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **kwargs)
    with hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **kwargs,
                                                       **SMALL) as model:
        ids = torch.randint(3, 1024, (1, 30), generator=torch.Generator().manual_seed(2))
        assert torch.equal(model.generate(ids, max_new_tokens=8),
                           stock.generate(ids, max_new_tokens=8))
        torch.testing.assert_close(model(ids).logits, stock(ids).logits,
                                   atol=1e-4, rtol=FLOAT32_RTOL)
    with pytest.raises(ValueError, match="output_attentions"):
        hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, output_attentions=True,
                                                      **SMALL)
    # the model call's per-layer hidden states by default, as the config says
    with hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, output_hidden_states=True,
                                                       **SMALL) as model:
        ids = torch.randint(3, 1024, (1, 9), generator=torch.Generator().manual_seed(2))
        stock = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint,
                                                                  output_hidden_states=True)
        assert_streams_equal(model(ids).hidden_states, stock(ids).hidden_states)
        assert torch.equal(model.generate(ids, max_new_tokens=4),
                           stock.generate(ids, max_new_tokens=4))
