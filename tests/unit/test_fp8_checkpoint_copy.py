"""``benchmarks.fp8_checkpoint``: the FP8 copy written beside its source, file by file, is the
checkpoint that quantizing a copy in place gives, and the source is left as it was."""

from __future__ import annotations

import filecmp
import json
import os
import shutil

import torch
import transformers
from safetensors.torch import load_file

from benchmarks.fp8_checkpoint import quantize_checkpoint
from hf_paged.random_checkpoint import quantize_fp8, random_qwen3
from tests.conftest import FP8_CONFIGS


def test_copy_matches_quantizing_in_place_and_leaves_the_source(tmp_path):
    config = transformers.AutoConfig.for_model(
        **{"model_type": "qwen3", **FP8_CONFIGS["blocks_untied"]}, dtype="float32")
    src = tmp_path / "src"
    random_qwen3(config, seed=0).save_pretrained(src, max_shard_size="200KB")  # an index
    files = sorted(os.listdir(src))
    assert "model.safetensors.index.json" in files
    before = {f: (src / f).read_bytes() for f in files}
    in_place = tmp_path / "in_place"
    shutil.copytree(src, in_place)
    quantize_fp8(str(in_place), config)

    dst = tmp_path / "dst"
    quantize_checkpoint(str(src), str(dst))

    assert {f: (src / f).read_bytes() for f in sorted(os.listdir(src))} == before
    assert sorted(os.listdir(dst)) == sorted(os.listdir(in_place))
    fp8_tensors = 0
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            got, want = load_file(dst / name), load_file(in_place / name)
            assert got.keys() == want.keys()
            fp8_tensors += sum(t.dtype == torch.float8_e4m3fn for t in got.values())
            for key in want:
                assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
        elif name.endswith(".json"):
            assert json.loads((dst / name).read_text()) == json.loads((in_place / name).read_text())
        else:
            assert filecmp.cmp(dst / name, in_place / name, shallow=False), name
    assert fp8_tensors == 7 * config.num_hidden_layers  # q k v o gate up down
