"""The hybrid families under tensor parallelism on CPU over gloo (two spawned ranks, in a
subprocess with a timeout): each rank holds half the attention heads, half the Gated DeltaNet
key and value heads with their state pools, half of every MLP and expert; float32 tokens
against stock transformers', through chunked prefill and preemption, and beams; the model
call (logits, loss, hidden states) too."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.conftest import left_padded
from tests.parallel.test_tensor_parallel import BEAMS, CPU, TIGHT, check_model_call, run_jobs

NAMES = ["next_dense1", "qwen3.5_one_value_head_a_key"]
CALL = dict(lengths=[20, 25, 30, 35], seed=2, generate=dict(max_new_tokens=8))


def reference(path: str, call: dict) -> list:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded(call["lengths"], model.config.vocab_size, seed=call["seed"])
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                              **call["generate"]).tolist()


@pytest.fixture(scope="module")
def results(hybrid_checkpoints, tmp_path_factory) -> list[dict]:
    jobs = [dict(checkpoint=hybrid_checkpoints[name],
                 engine=dict(CPU, **TIGHT, tensor_parallel_size=2), calls=[CALL, BEAMS],
                 model_object=True)
            for name in NAMES]
    # Qwen3-Next's routed experts split whole over the ranks (its shared expert by its
    # intermediate size)
    jobs.append(dict(checkpoint=hybrid_checkpoints[NAMES[0]],
                     engine=dict(CPU, **TIGHT, tensor_parallel_size=2, moe_parallel="experts"),
                     calls=[CALL]))
    out = tmp_path_factory.mktemp("hybrid_tp") / "results.json"
    run_jobs(jobs, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("index", range(len(NAMES)))
def test_tp2_matches_transformers(results, hybrid_checkpoints, index):
    path, result = hybrid_checkpoints[NAMES[index]], results[index]
    assert result["outputs"] == [reference(path, CALL), reference(path, BEAMS)]
    assert result["stats"]["num_preemptions"] > 0, result["stats"]


def test_tp2_expert_parallel_matches_transformers(results, hybrid_checkpoints):
    path = hybrid_checkpoints[NAMES[0]]
    assert results[len(NAMES)]["outputs"] == [reference(path, CALL)]


@pytest.mark.parametrize("index", range(len(NAMES)))
def test_tp2_model_call_matches_transformers(results, hybrid_checkpoints, index):
    """The model call on both ranks (each its state heads, scratch state slots a row)."""
    stock = transformers.AutoModelForCausalLM.from_pretrained(
        hybrid_checkpoints[NAMES[index]], dtype=torch.float32).eval()
    with torch.no_grad():
        check_model_call(results[index]["model_call"], stock)
