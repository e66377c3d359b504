"""``generate(..., adapter_names=[...])`` (PEFT's keyword for a batch of mixed LoRA adapters)
over an engine holding two PEFT adapters of the tiny checkpoint, against PEFT's own mixed
batch; what it is not served with, refused by name; and ``hf-paged generate --lora NAME=PATH
--adapter NAME --check``."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from peft import PeftModel

import hf_paged
from hf_paged.cli import main
from hf_paged.generation.generate import check
from hf_paged.lora.named import load_loras
from tests.conftest import SMALL
from tests.lora_helpers import save_adapters, stock_model

PROMPTS = [[5, 60, 7, 80, 9], [11, 12, 13], [300, 301, 7, 9, 44, 2, 18]]
NAMES = ["a", "__base__", "b"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    return save_adapters(tiny_checkpoint, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, adapters):
    engine = hf_paged.from_pretrained(tiny_checkpoint, device="cpu", **SMALL)
    load_loras(engine, adapters)
    yield engine
    engine.close()


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module")
def peft_tokens(tiny_checkpoint, adapters) -> torch.Tensor:
    """PEFT's greedy mixed batch: both adapters loaded, ``NAMES`` a row."""
    model = PeftModel.from_pretrained(stock_model(tiny_checkpoint), adapters["a"],
                                      adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    ids, mask = padded(PROMPTS)
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                    do_sample=False, adapter_names=NAMES)
    return out


def test_mixed_batch_as_peft(engine, peft_tokens):
    ids, mask = padded(PROMPTS)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                          adapter_names=NAMES)
    assert torch.equal(out, peft_tokens)
    base = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    differ = [not torch.equal(out[i], base[i]) for i in range(len(NAMES))]
    assert differ == [True, False, True]  # the adapters change greedy tokens


def test_copies_of_a_row_keep_its_adapter(engine, peft_tokens):
    """num_return_sequences=2 (forked rows, sampling with top_k=1: greedy's tokens): each copy
    of a row runs with that row's adapter."""
    ids, mask = padded(PROMPTS)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True,
                          top_k=1, num_return_sequences=2, adapter_names=NAMES)
    assert torch.equal(out, peft_tokens.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(adapter_names=["a", "b"]), "adapter_names: a list of one name per input row (3)"),
    (dict(adapter_names="a"), "adapter_names: a list of one name per input row"),
    (dict(adapter_names=["a", "c", "b"]), "adapter 'c' is not loaded"),
    (dict(adapter_names=NAMES, num_beams=2), "greedy search and sampling only, not beam_search"),
    (dict(adapter_names=NAMES, prompt_lookup_num_tokens=2),
     "greedy search and sampling only, not assisted_generation"),
])
def test_refused_by_name(engine, kwargs, match):
    """By generate, and by check (what a server asks before a response starts)."""
    ids, mask = padded(PROMPTS)
    for call in (engine.generate, partial(check, engine)):
        with pytest.raises(ValueError, match=re.escape(match)):
            call(ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    assert engine.stats()["num_waiting"] == engine.stats()["num_running"] == 0


def test_fully_masked_row_refused(engine):
    ids, mask = padded(PROMPTS)
    mask[1] = 0
    with pytest.raises(ValueError, match="adapter_names: row 1 keeps no prompt token"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4, adapter_names=NAMES)


def test_cli_generates_with_an_adapter_as_peft(capsys, tiny_checkpoint, adapters):
    lora = [f"--lora={name}={path}" for name, path in adapters.items()]
    assert main(["generate", "--model", tiny_checkpoint, "--device", "cpu", "--prompt",
                 "Hello there", "--max-new-tokens", "8", *lora, "--adapter", "b",
                 "--check"]) == 0
    out = capsys.readouterr().out
    assert "+a +b on cpu" in out and "parity with transformers: identical tokens" in out, out


@pytest.mark.parametrize("args, match", [
    (["--lora", "a"], "--lora takes NAME=PATH"),
    (["--lora", "a=/no/such/folder"], "--lora a=/no/such/folder: no such folder"),
    (["--adapter", "a"], "--adapter a: no --lora loads an adapter of that name"),
])
def test_cli_bad_lora_is_one_line(capsys, tiny_checkpoint, args, match):
    assert main(["generate", "--model", tiny_checkpoint, "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err
