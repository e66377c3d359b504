"""Every invalid request is rejected with a ValueError naming the argument, and the engine
serves the next call as if nothing had happened."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from transformers import GenerationConfig, PretrainedConfig

import hf_paged
from hf_paged.engine.loading import resolve_dtype
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.backend import resolve_backend

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def engine(checkpoints):
    return hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def expected(engine):
    return engine.generate(IDS, max_new_tokens=5)


BAD_CALLS = [
    (dict(input_ids=torch.tensor([[5, 6, 10**6]])), "input_ids"),
    (dict(input_ids=torch.tensor([[5, -3, 6]])), "input_ids"),
    (dict(input_ids=IDS, max_new_tokens=200), "max_new_tokens"),
    (dict(input_ids=IDS, max_new_tokens=0), "max_new_tokens"),
    (dict(input_ids=IDS, max_new_tokens=-2), "max_new_tokens"),
    (dict(input_ids=IDS, max_new_tokens=None, max_length=3), "max_length"),
    (dict(input_ids=IDS, do_sample=True, temperature=-1.0), "temperature"),
    (dict(input_ids=IDS, do_sample=True, top_p=0.0), "top_p"),
    (dict(input_ids=torch.tensor([5, 6, 7])), "input_ids"),
    (dict(input_ids=torch.zeros((1, 2, 3), dtype=torch.long)), "input_ids"),
    (dict(input_ids=IDS.float()), "input_ids"),
    (dict(input_ids=IDS, attention_mask=torch.ones((1, 5))), "attention_mask"),
    (dict(input_ids=IDS, attention_mask=torch.tensor([[1, 0, 1, 1]])), "attention_mask"),
    (dict(input_ids=IDS, repetition_penalty=-1.0), "penalty"),
    (dict(input_ids=IDS, output_attentions=True, return_dict_in_generate=True),
     "output_attentions"),
    (dict(input_ids=IDS, assistant_model=object()), "assistant_model"),
    (dict(input_ids=IDS, assistant_tokenizer=object()), "assistant_tokenizer"),
    (dict(input_ids=IDS, prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens"),
    (dict(input_ids=IDS, prompt_lookup_num_tokens=2.5), "prompt_lookup_num_tokens"),
    (dict(input_ids=IDS, prompt_lookup_num_tokens=2, max_matching_ngram_size=-1),
     "max_matching_ngram_size"),
    (dict(input_ids=IDS, position_ids=torch.arange(4)[None]), "position_ids"),
    (dict(input_ids=IDS, stop_strings="x"), "tokenizer"),
    (dict(input_ids=IDS, num_beams=0), "^num_beams must be a positive integer, got 0$"),
    (dict(input_ids=IDS, num_beams=2.0), "^num_beams must be a positive integer, got 2.0$"),
    (dict(input_ids=IDS, num_return_sequences=0), "^num_return_sequences must be a positive"),
    (dict(input_ids=IDS[:, :0]), r"^input_ids is empty \(shape \(1, 0\)\)"),
    (dict(input_ids=IDS, streamer=object()), "streamer"),
    (dict(input_ids=IDS, generation_config={"max_new_tokens": 3}), "generation_config"),
]


@pytest.mark.parametrize("kwargs,name", BAD_CALLS, ids=[n for _, n in BAD_CALLS])
def test_bad_call_names_the_argument_and_engine_survives(engine, expected, kwargs, name):
    kwargs = {"max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=name):
        engine.generate(**kwargs)
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0
    assert torch.equal(engine.generate(IDS, max_new_tokens=5), expected)


def test_one_bad_prompt_queues_nothing(engine, expected):
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate_tokens([[5, 6], []], SamplingParams(max_new_tokens=3))
    assert engine.stats()["num_waiting"] == 0
    assert torch.equal(engine.generate(IDS, max_new_tokens=5), expected)


def test_request_larger_than_the_whole_cache_is_refused(checkpoints):
    """4 blocks of 8 tokens hold 32: a 30-token prompt with 10 new tokens can never run, so it
    is refused up front instead of preempting forever; a request that fits still runs."""
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_model_len=64,
                                      num_kv_blocks=4)
    prompt = torch.arange(3, 33)[None]
    with pytest.raises(ValueError, match="max_new_tokens: the request needs 5 KV blocks"):
        engine.generate(prompt, max_new_tokens=10)
    assert engine.generate(prompt, max_new_tokens=2).shape == (1, 32)
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


# Decoding modes transformers selects from these fields and hf_paged does not decode: the
# error names the field the caller set, not transformers' GenerationMode.
REFUSED_MODES = [
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6, top_k=4 (contrastive search)"),
    (dict(dola_layers="low"), "dola_layers='low' (DoLa decoding)"),
    (dict(dola_layers=[1], do_sample=True), "dola_layers (DoLa decoding)"),
    (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
     "num_beam_groups=2, num_beams=4 (group beam search)"),
    (dict(num_beams=2, constraints=[[5, 6]]), "constraints (constrained beam search)"),
    (dict(force_words_ids=[[5]]), "force_words_ids (constrained beam search)"),
    (dict(use_mtp=True),
     "use_mtp=True (assisted generation by multi-token prediction or early exit)"),
    (dict(assistant_early_exit=2),
     "assistant_early_exit=2 (assisted generation by multi-token prediction or early exit)"),
]


@pytest.mark.parametrize("kwargs,message", REFUSED_MODES, ids=[m for _, m in REFUSED_MODES])
def test_refused_mode_names_the_argument(engine, expected, kwargs, message):
    with pytest.raises(ValueError) as error:
        engine.generate(IDS, max_new_tokens=5, **kwargs)
    text = str(error.value)
    assert text.startswith(message + " is not supported by hf_paged's generate()"), text
    assert "GenerationMode" not in text and "greedy search, sampling" in text
    assert torch.equal(engine.generate(IDS, max_new_tokens=5), expected)


def test_refused_mode_from_a_generation_config_names_the_field(engine):
    config = GenerationConfig(penalty_alpha=0.6, top_k=4, max_new_tokens=5)
    with pytest.raises(ValueError, match=r"^penalty_alpha=0\.6, top_k=4 \(contrastive search\)"):
        engine.generate(IDS, generation_config=config)


def test_prompt_longer_than_max_model_len_blames_the_prompt(engine, expected):
    """max_model_len is 64: a prompt of 64 or more tokens leaves no room for any new token,
    whatever max_new_tokens says; a prompt that fits blames max_new_tokens, with the room."""
    for length in (64, 70):
        with pytest.raises(ValueError, match=f"^input_ids: the prompt of {length} tokens leaves "
                           "no room for a new token within max_model_len \\(64"):
            engine.generate(torch.arange(3, 3 + length)[None], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"^max_new_tokens: prompt \(60 tokens\) \+ "
                       r"max_new_tokens \(10\) = 70 exceeds max_model_len \(64\); at most 4 "):
        engine.generate(torch.arange(3, 63)[None], max_new_tokens=10)
    assert engine.generate(torch.arange(3, 63)[None], max_new_tokens=4).shape == (1, 64)
    assert torch.equal(engine.generate(IDS, max_new_tokens=5), expected)


def test_prompt_larger_than_the_whole_cache_blames_the_prompt(checkpoints):
    """4 blocks of 8 tokens hold 32: a 32-token prompt plus its first new token needs 5."""
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_model_len=64,
                                      num_kv_blocks=4)
    with pytest.raises(ValueError, match=r"^input_ids: the prompt of 32 tokens \(plus one new "
                       r"token\) needs 5 KV blocks but the whole cache has 4 \(32 tokens\)"):
        engine.generate(torch.arange(3, 35)[None], max_new_tokens=1)
    with pytest.raises(ValueError, match="at most 2 new tokens fit after this prompt"):
        engine.generate(torch.arange(3, 33)[None], max_new_tokens=3)
    assert engine.generate(torch.arange(3, 33)[None], max_new_tokens=2).shape == (1, 32)


@pytest.mark.parametrize("dtype", ["floa32", "int8", "zeros", torch.int64, 3])
def test_bad_dtype_names_argument_value_and_accepted(checkpoints, dtype):
    with pytest.raises(ValueError, match=f"^dtype must be one of float32, bfloat16, float16 "
                       f".*got {re.escape(repr(dtype))}$"):
        hf_paged.from_pretrained(checkpoints["gqa_tied"], dtype=dtype)


@pytest.mark.parametrize("dtype,expected", [
    (None, torch.float32), ("auto", torch.float32), ("bfloat16", torch.bfloat16),
    ("torch.float16", torch.float16), ("half", torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_dtype_names_resolve(dtype, expected):
    assert resolve_dtype(dtype, PretrainedConfig()) is expected


@pytest.mark.parametrize("options,name", [
    (dict(block_size=12), "block_size"),
    (dict(progress_bar="yes"), "progress_bar"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="magic"), "attention_backend"),
    (dict(max_model_len=10**7), "max_model_len"),
    (dict(disable_custom_all_reduce="yes"), "disable_custom_all_reduce"),
])
def test_bad_engine_options_name_the_option(checkpoints, options, name):
    with pytest.raises(ValueError, match=name):
        hf_paged.from_pretrained(checkpoints["gqa_tied"], **options)


def test_unknown_engine_option(checkpoints):
    with pytest.raises(TypeError, match="no_such_option"):
        hf_paged.from_pretrained(checkpoints["gqa_tied"], no_such_option=1)


def test_non_qwen3_checkpoint_is_refused(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Qwen3"):
        hf_paged.from_pretrained(str(tmp_path))


def test_sampling_params_validate():
    for kwargs, name in [(dict(max_new_tokens=0), "max_new_tokens"),
                         (dict(temperature=-0.5), "temperature"),
                         (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
                         (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_flash_attn_backend_states_what_it_needs(monkeypatch):
    cuda = torch.device("cuda")  # resolve_backend only reads the device type
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' needs .* flash-attn"):
        resolve_backend("flash_attn", cuda, 256)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flash_attn", torch.device("cpu"), 256)
    with pytest.raises(ValueError, match="block_size 256"):
        resolve_backend("flash_attn", cuda, 16)
    assert resolve_backend("flash_attn", cuda, 256) == "flash_attn"
