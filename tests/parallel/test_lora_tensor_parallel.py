"""LoRA adapters under tensor parallelism (two ranks on CPU over gloo, float32), against the
same engine at TP=1 and stock transformers + peft: a mixed batch of adapters (all seven
projections, q/v only, attention only, each of another rank) and the base model, with chunked
prefill; an adapter removed and loaded again while a request on another runs, and one of too
high a rank refused meanwhile. One shape splits its KV heads between the ranks, the other
replicates its only KV head on both. Spawned ranks get the adapters from rank 0; under
torchrun every rank loads them itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FLOAT32_RTOL, left_padded
from tests.lora_adapters import ADAPTERS, save_adapter, stock_peft
from tests.parallel.run_lora import NEW
from tests.parallel.test_tensor_parallel import ROOT, TIMEOUT_S
from tests.parity.test_lora_engine import engine_with

SHAPES = ["gqa4_untied", "one_kv_head"]
MIXED = dict(lengths=[5, 17, 11, 8], seed=2, names=["qv", "__base__", "all", "attn"])
LATE = dict(prompts=[[7, 3, 91, 12, 44, 8, 19, 300, 5], [17, 2, 5, 88, 61, 9, 140, 33, 71, 6, 4]],
            first="qv", second="attn")
# A 16-token budget splits the mixed call's prompts (chunked prefill with adapter rows).
ENGINE = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=16,
              max_loras=3)
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run_jobs(jobs: list[dict], out: Path, launcher: list[str] = ()) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *launcher, "-m", "tests.parallel.run_lora",
                           json.dumps(jobs), str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Each shape's adapters (name -> folder)."""
    out = {}
    for shape in SHAPES:
        folder = tmp_path_factory.mktemp(f"lora_tp_{shape}")
        out[shape] = {name: save_adapter(checkpoints[shape], str(folder / name), seed, **lora)
                      for seed, (name, lora) in enumerate(ADAPTERS.items())}
    return out


@pytest.fixture(scope="module")
def tp2(checkpoints, adapters, tmp_path_factory) -> list[dict]:
    jobs = [dict(checkpoint=checkpoints[shape], adapters=adapters[shape], mixed=MIXED,
                 late=LATE, engine=dict(ENGINE, tensor_parallel_size=2)) for shape in SHAPES]
    out = tmp_path_factory.mktemp("lora_tp") / "results.json"
    run_jobs(jobs, out)
    return json.loads(out.read_text())


def stock_mixed(checkpoint: str, adapters: dict[str, str]) -> tuple[torch.Tensor, dict,
                                                                     torch.Tensor]:
    """The mixed call's prompts and generate arguments, and stock + peft's output."""
    ids, mask = left_padded(MIXED["lengths"], 1024, seed=MIXED["seed"])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                  adapter_names=MIXED["names"])
    return ids, kwargs, stock_peft(checkpoint, adapters).generate(input_ids=ids, **kwargs)


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=SHAPES)
def test_tp2_mixed_adapters_match_tp1_and_peft(checkpoints, adapters, tp2, index):
    shape = SHAPES[index]
    ids, kwargs, stock = stock_mixed(checkpoints[shape], adapters[shape])
    with engine_with(checkpoints[shape], adapters[shape], block_size=8,
                     max_num_batched_tokens=16) as engine:
        tp1 = engine.generate(ids, **kwargs)
    assert torch.equal(tp1, stock)
    assert tp2[index]["mixed"] == stock[:, ids.shape[1]:].tolist()
    scored = stock_peft(checkpoints[shape], adapters[shape])(
        input_ids=ids, attention_mask=kwargs["attention_mask"], adapter_names=MIXED["names"])
    torch.testing.assert_close(torch.tensor(tp2[index]["logits"]), scored.logits, atol=1e-4,
                               rtol=FLOAT32_RTOL)


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=SHAPES)
def test_tp2_adapter_removed_and_loaded_while_a_request_runs(checkpoints, adapters, tp2,
                                                             index):
    shape, result = SHAPES[index], tp2[index]
    stock = stock_peft(checkpoints[shape], adapters[shape])
    expected = [stock.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW,
                               do_sample=False, adapter_names=[name])[0, len(prompt):].tolist()
                for prompt, name in zip(LATE["prompts"], [LATE["first"], LATE["second"]])]
    assert result["late"] == expected
    assert "adapter 'attn' is not loaded" in result["removed_error"]
    # checked on rank 0 before it reaches the other: the ranks stay in step
    assert "above max_lora_rank=64" in result["refused_error"]
    assert result["num_loras"] == len(ADAPTERS)


def test_torchrun_ranks_load_their_own_shards(checkpoints, adapters, tmp_path):
    shape = SHAPES[1]
    job = dict(checkpoint=checkpoints[shape], adapters=adapters[shape], mixed=MIXED,
               engine=dict(ENGINE, tensor_parallel_size=2))
    out = tmp_path / "results.json"
    run_jobs([job], out, TORCHRUN)
    ids, _, stock = stock_mixed(checkpoints[shape], adapters[shape])
    for rank in (0, 1):
        [result] = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert result["mixed"] == stock[:, ids.shape[1]:].tolist(), rank
