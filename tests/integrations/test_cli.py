"""The command line: one-line errors for bad input, labelled --check output, ``run``."""

from __future__ import annotations

import pytest
import torch

from hf_paged.cli import main


def _one_line_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err


@pytest.mark.parametrize("args, match", [
    (["--token-ids", "1,x"], "--token-ids"),
    (["--token-ids", "5,6,7", "--max-new-tokens", "100000"], "max_new_tokens"),
    (["--token-ids", "5,6,5000"], "input_ids"),
    (["--dtype", "int4"], "dtype"),
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


def test_check_labels_what_it_prints(capsys, tiny_checkpoint):
    argv = ["generate", "--model", tiny_checkpoint, "--prompt", "Hello there", "--prompt",
            "The river", "--max-new-tokens", "4", "--check", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label in ("hf_paged [0]: '", "hf_paged [1]: '", "transformers [0]: '",
                  "transformers [1]: '", "parity with transformers: identical tokens"):
        assert label in out
