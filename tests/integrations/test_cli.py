"""The command line: one-line errors for bad input, labelled --check output, ``run``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_paged
from hf_paged import cli
from hf_paged.cli import main

ROOT = str(Path(__file__).resolve().parents[2])


def _one_line_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err


@pytest.mark.parametrize("args, match", [
    (["--token-ids", "1,x"], "--token-ids"),
    (["--token-ids", "5,6,7", "--max-new-tokens", "100000"], "max_new_tokens"),
    (["--token-ids", "5,6,5000"], "input_ids"),
    (["--dtype", "int4"], "dtype"),
    (["--kv-cache-dtype", "fp8", "--check"], "--check compares tokens with stock transformers"),
    (["--dtype", "floa32"], "dtype must be one of float32, bfloat16, float16"),
    (["--prompt", ""], "--prompt '' tokenizes to no tokens"),
    (["--prompt", "Hello", "--prompt", ""], "--prompt '' tokenizes to no tokens"),
    (["--token-ids", "5,6,7", "--max-new-tokens", "100000"], "at most 2045 new tokens fit"),
])
def test_bad_generate_input_is_one_line(capsys, tiny_checkpoint, args, match):
    _one_line_error(capsys, ["generate", "--model", tiny_checkpoint, *args], match)


def test_cuda_without_cuda_is_one_line(capsys, tiny_checkpoint):
    argv = ["generate", "--model", tiny_checkpoint, "--device", "cuda", "--max-new-tokens", "2"]
    if torch.cuda.is_available():
        assert main(argv) == 0
    else:
        _one_line_error(capsys, argv, "CUDA is not available")


def test_missing_script_and_model(capsys, tmp_path):
    _one_line_error(capsys, ["run", str(tmp_path / "absent.py")], "absent.py")
    _one_line_error(capsys, ["generate", "--model", str(tmp_path / "absent")], "absent")


@pytest.mark.parametrize("model", ["/no/such/folder", "not a valid id!", "no-org/no-repo"])
def test_bad_model_is_one_line_naming_model(capsys, monkeypatch, model):
    """Not a folder and not fetchable: the hub's own wall of text is cut to its class names."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never the network
    assert main(["generate", "--model", model, "--token-ids", "5,6"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: --model {re.escape(repr(model))} is neither a local folder nor "
                        r"reachable on the hub \(\w+(: \w+)?\)\n", err), err


def test_unreachable_hub_names_the_cause(capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "no-such-org/no-such-repo"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "(LocalEntryNotFoundError: OfflineModeIsEnabled)")


def test_folder_without_config_is_one_line(capsys, tmp_path):
    _one_line_error(capsys, ["generate", "--model", str(tmp_path)],
                    f"--model {str(tmp_path)!r} is a folder without a config.json")


def test_check_labels_what_it_prints(capsys, tiny_checkpoint):
    argv = ["generate", "--model", tiny_checkpoint, "--prompt", "Hello there", "--prompt",
            "The river", "--max-new-tokens", "4", "--check", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label in ("hf_paged [0]: '", "hf_paged [1]: '", "transformers [0]: '",
                  "transformers [1]: '", "parity with transformers: identical tokens"):
        assert label in out


def test_generate_on_an_fp8_kv_cache(capsys, tiny_checkpoint):
    argv = ["generate", "--model", tiny_checkpoint, "--token-ids", "5,6,7", "--max-new-tokens",
            "4", "--kv-cache-dtype", "fp8", "--device", "cpu"]
    assert main(argv) == 0
    assert "hf_paged: 1 sequences, 4 new tokens" in capsys.readouterr().out


def test_a_qwen3_moe_checkpoint_with_fewer_layers_generates_as_transformers(capsys, tmp_path):
    out_dir = str(tmp_path / "moe")
    assert main(["make-checkpoint", "--shape", "tiny-moe", "--layers", "3", "--dtype",
                 "float32", out_dir]) == 0
    with open(f"{out_dir}/config.json") as f:
        config = json.load(f)
    assert (config["model_type"], config["num_hidden_layers"]) == ("qwen3_moe", 3)
    assert main(["generate", "--model", out_dir, "--prompt", "Hello there", "--prompt",
                 "The river", "--max-new-tokens", "6", "--check", "--device", "cpu"]) == 0
    assert "parity with transformers: identical tokens" in capsys.readouterr().out


def test_a_qwen3_5_vision_language_release_generates_as_transformers(capsys, tmp_path):
    """The layout the hub ships Qwen3.5 in: its text model served, as transformers' causal LM
    serves it."""
    out_dir = str(tmp_path / "vl")
    assert main(["make-checkpoint", "--shape", "tiny-qwen3.5-vl", "--dtype", "float32",
                 out_dir]) == 0
    with open(f"{out_dir}/config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert main(["generate", "--model", out_dir, "--prompt", "Hello there", "--prompt",
                 "The river", "--max-new-tokens", "6", "--check", "--device", "cpu"]) == 0
    assert "parity with transformers: identical tokens" in capsys.readouterr().out


def _copy(checkpoint: str, folder) -> str:
    shutil.copytree(checkpoint, folder)
    return str(folder)


def test_damaged_checkpoint_file_is_one_line_naming_it(capsys, tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "cut")
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    _one_line_error(capsys, ["generate", "--model", path, "--device", "cpu"],
                    f"error: {file} is truncated or corrupt, not a readable safetensors file")


def test_checkpoint_that_does_not_fit_is_one_readable_line(capsys, tiny_checkpoint, tmp_path):
    """The API's listing (a heading, then a key a line) reads as 'missing (1): key; ...'."""
    path = _copy(tiny_checkpoint, tmp_path / "misfit")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    _one_line_error(capsys, ["generate", "--model", path, "--device", "cpu"],
                    "config.json describes it; nothing was loaded; missing (1): "
                    "model.layers.1.self_attn.q_proj.weight; wrong shape (1): "
                    "model.layers.0.mlp.gate_proj.weight: checkpoint [3, 64], model [128, 64]")


def test_version_names_hf_paged_transformers_and_torch(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == (
        f"hf-paged {hf_paged.__version__} (transformers {version('transformers')}, "
        f"torch {version('torch')})\n")


def test_default_checkpoint_says_where_it_is_written(capsys, monkeypatch, tmp_path):
    """Written once, where the message says, then reused without a word."""
    monkeypatch.setattr(cli, "DEFAULT_MODEL", tmp_path / "default")
    argv = ["generate", "--device", "cpu", "--max-new-tokens", "2"]
    assert main(argv) == 0
    written = f"wrote a random tiny Qwen3 checkpoint to {tmp_path / 'default'}"
    assert written in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "default" / "config.json")
    assert main(argv) == 0
    assert "wrote" not in capsys.readouterr().out


def test_sampled_check_says_it_cannot_compare(capsys, tiny_checkpoint):
    argv = ["generate", "--model", tiny_checkpoint, "--token-ids", "5,6,7", "--do-sample",
            "--max-new-tokens", "4", "--check", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "transformers [0]: " in out and "DIFFERENT" not in out
    assert ("parity with transformers: not compared: sampled tokens cannot be compared token "
            "for token") in out


@pytest.mark.parametrize("argv", [["--version"], ["generate", "--help"], ["--help"]])
def test_help_and_version_import_neither_torch_nor_transformers(argv):
    """The command line imports what a command needs when it runs: asking for help or the
    version takes a fraction of a second, not the seconds torch and transformers take."""
    code = ("import sys\nfrom hf_paged.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_an_fp8_checkpoint_generates_as_transformers(capsys, tmp_path):
    out_dir = str(tmp_path / "fp8")
    assert main(["make-checkpoint", "--shape", "tiny-moe", "--quantize", "fp8", "--dtype",
                 "float32", out_dir]) == 0
    with open(f"{out_dir}/config.json") as f:
        quantization_config = json.load(f)["quantization_config"]
    assert quantization_config == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate",
                                   "model.layers.1.mlp.gate"]}
    assert main(["generate", "--model", out_dir, "--prompt", "Hello there", "--max-new-tokens",
                 "6", "--check", "--device", "cpu"]) == 0
    assert "parity with transformers: identical tokens" in capsys.readouterr().out
