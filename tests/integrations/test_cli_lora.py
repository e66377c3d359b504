"""``hf-paged generate --lora NAME=PATH --adapter NAME``: generating with a PEFT adapter of the
tiny checkpoint, ``--check`` against stock transformers + PEFT; bad flags in one line."""

from __future__ import annotations

import sys

import pytest

from hf_paged.cli import main
from hf_paged.lora.named import AdapterSpecError, check_loras
from tests.lora_adapters import ADAPTERS, save_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_adapter(tiny_checkpoint, str(root / name), seed, **ADAPTERS[name])
            for seed, name in enumerate(("qv", "all"))}


def test_generates_with_an_adapter_as_peft(capsys, tiny_checkpoint, adapters):
    lora = [f"--lora={name}={path}" for name, path in adapters.items()]
    assert main(["generate", "--model", tiny_checkpoint, "--device", "cpu", "--prompt",
                 "Hello there", "--prompt", "The river", "--max-new-tokens", "8", *lora,
                 "--adapter", "all", "--check"]) == 0
    out = capsys.readouterr().out
    assert "+qv +all on cpu" in out and "parity with transformers: identical tokens" in out, out


@pytest.mark.parametrize("args, match", [
    (["--lora", "a"], "--lora takes NAME=PATH"),
    (["--lora", "a=/no/such/folder"], "--lora a=/no/such/folder: no such folder"),
    (["--adapter", "a"], "--adapter a: no --lora loads an adapter of that name"),
])
def test_bad_lora_is_one_line(capsys, tiny_checkpoint, args, match):
    assert main(["generate", "--model", tiny_checkpoint, "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err


def test_lora_without_peft_is_one_line(monkeypatch, tmp_path):
    """--lora reads adapters with peft (the lora extra): without it, one line says so."""
    for module in ("hf_paged.lora.checks", "hf_paged.lora.reading"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(AdapterSpecError, match=r"--lora needs peft.*hf_paged\[lora\]"):
        check_loras({"a": str(tmp_path)}, None)
