"""Tensor parallelism on CPU over gloo, against stock transformers float32 (exact tokens):
ranks spawned from an ordinary process, torchrun mode, a killed worker, and data parallelism
under accelerate; FP8 checkpoints (dense and MoE) against the same engine at TP=1. The
multi-process runs are two subprocesses (one spawning, one torchrun) with a timeout each, so
that a hang fails the tests instead of stalling the run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

import hf_paged
from hf_paged.families import check_model
from hf_paged.random_checkpoint import quantize_fp8
from tests.conftest import FLOAT32_RTOL, left_padded
from tests.parallel.run_engine import SCORE

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # generous for two busy cores; a hang takes this long to fail
# A cache of 12 blocks of 8 tokens cannot hold the four requests at once (preemption; a
# preempted request finds its blocks in the prefix cache when it comes back), and a 16-token
# budget splits their prompts (chunked prefill).
TIGHT = dict(block_size=8, num_kv_blocks=12, max_num_batched_tokens=16)
CPU = dict(device="cpu", block_size=8)  # gloo even where a GPU is present
CALL = dict(lengths=[20, 25, 30, 35], seed=2, generate=dict(max_new_tokens=12))
SAMPLED = dict(CALL, generate=dict(max_new_tokens=12, do_sample=True, temperature=1.5, top_k=50,
                                   top_p=0.95))
SCORED = dict(CALL, generate=dict(max_new_tokens=4, output_scores=True,
                                  return_dict_in_generate=True))
BEAMS = dict(CALL, generate=dict(max_new_tokens=8, num_beams=3, num_return_sequences=2))
LOOKUP = dict(CALL, generate=dict(max_new_tokens=40, prompt_lookup_num_tokens=3,
                                  max_matching_ngram_size=1))
DP_CALL = dict(lengths=[5, 9, 14, 3, 11], seed=7, generate=dict(max_new_tokens=8))
SPAWNED = ["gqa_tied", "mha_untied", "one_kv_head"]
MOE = "e6_k3_raw_dense0"
# Expert parallelism: each of the two ranks holds three of the MoE checkpoint's six experts.
EXPERTS = dict(tensor_parallel_size=2, moe_parallel="experts")
# transformers' FineGrainedFP8Config(dequantize=True) as a dict (jobs travel as JSON)
DEQUANTIZE = {"quant_method": "fp8", "weight_block_size": [128, 128], "dequantize": True}
# FP8 blocks small enough that two ranks' slices are whole blocks of these tiny shapes.
FP8_BLOCKS = {"gqa4_untied": (32, 32), MOE: (16, 16)}


def run_jobs(jobs: list[dict], out: Path, launcher: list[str] = (), returncode: int = 0,
             timeout: float = TIMEOUT_S) -> None:
    """Run ``jobs`` in a subprocess (``run_engine``); a run that hangs prints every thread's
    stack and exits 10 s before ``timeout``, so the failure says where it stood."""
    # One thread a process, as torchrun sets it: ranks spinning on shared cores crawl. The
    # marker in the environment, which every rank inherits, finds the run's processes.
    marker = uuid.uuid4().hex
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               RUN_ENGINE_HANG_S=str(timeout - 10), HF_PAGED_TEST_RUN=marker)
    proc = subprocess.run(
        [sys.executable, *launcher, "-m", "tests.parallel.run_engine", json.dumps(jobs),
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-6000:]
    # No rank outlives the run (a worker whose rank 0 was killed notices within a second),
    # and closed engines leave no thread or process group in their process.
    deadline = time.monotonic() + 10
    while (alive := processes_of(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"
    for result in out.parent.glob(out.name + "*"):
        runs = json.loads(result.read_text())
        assert not runs or not runs[-1].get("left_behind"), (result.name, runs[-1]["left_behind"])


def processes_of(marker: str) -> list[str]:
    """The command lines of the live processes whose environment holds ``marker``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"HF_PAGED_TEST_RUN={marker}".encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reference(hf_models, name: str, call: dict, new_only: bool = False) -> list:
    vocab = hf_models[name].config.vocab_size
    ids, mask = left_padded(call["lengths"], vocab, seed=call["seed"])
    out = hf_models[name].generate(ids, attention_mask=mask, do_sample=False, **call["generate"])
    return (out[:, ids.shape[1]:] if new_only else out).tolist()


@pytest.fixture(scope="module")
def spawned(checkpoints, tmp_path_factory) -> list[dict]:
    """TP=2 engines from this (ordinary) process; then the first is interrupted by Ctrl-C,
    the second (loaded as transformers' model object) has its worker killed, the last runs a
    logits processor that raises and is left open when the process dies by SIGKILL."""
    jobs = [dict(checkpoint=checkpoints[n], engine=dict(CPU, **TIGHT, tensor_parallel_size=2),
                 calls=[CALL], interrupt=i == 0, model_object=i == 1, kill_worker=i == 1,
                 failing_processor=i == 2, leave_open=i == 2)
            for i, n in enumerate(SPAWNED)]
    out = tmp_path_factory.mktemp("spawned") / "results.json"
    run_jobs(jobs, out, returncode=-signal.SIGKILL)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoints, moe_checkpoints, tmp_path_factory) -> dict[str, str]:
    """FP8 copies (``FP8_BLOCKS``) of a dense and a Qwen3-MoE checkpoint."""
    out = {}
    for name, block in FP8_BLOCKS.items():
        source = checkpoints.get(name) or moe_checkpoints[name]
        out[name] = str(tmp_path_factory.mktemp(f"fp8_{name}"))
        shutil.copytree(source, out[name], dirs_exist_ok=True)
        quantize_fp8(out[name], AutoConfig.from_pretrained(source), block)
    return out


@pytest.fixture(scope="module")
def torchrun(checkpoints, moe_checkpoints, fp8_checkpoints, tmp_path_factory
             ) -> list[list[dict]]:
    """Two launched ranks: one TP=2 engine (loaded as transformers' model object), a TP=2
    Qwen3-MoE engine (every expert split along moe_intermediate_size, a dense layer among the
    sparse ones), then one engine each for data parallelism, then TP=2 engines of FP8
    checkpoints (dense and MoE), then the MoE engines again with the experts split whole (bf16
    weights and FP8), then the FP8 MoE checkpoint dequantized as it loads."""
    jobs = [dict(checkpoint=checkpoints["gqa4_untied"],
                 engine=dict(CPU, tensor_parallel_size=2),
                 calls=[CALL, SAMPLED, SCORED, BEAMS, LOOKUP], model_object=True),
            dict(checkpoint=moe_checkpoints[MOE], engine=dict(CPU, **TIGHT,
                                                              tensor_parallel_size=2),
                 calls=[CALL, BEAMS]),
            dict(checkpoint=checkpoints["gqa_tied"], engine=CPU,
                 calls=[DP_CALL], data_parallel=True),
            dict(checkpoint=fp8_checkpoints["gqa4_untied"],
                 engine=dict(CPU, tensor_parallel_size=2), calls=[CALL, BEAMS]),
            dict(checkpoint=fp8_checkpoints[MOE], engine=dict(CPU, **TIGHT,
                                                              tensor_parallel_size=2),
                 calls=[CALL]),
            dict(checkpoint=moe_checkpoints[MOE], engine=dict(CPU, **TIGHT, **EXPERTS),
                 calls=[CALL, BEAMS]),
            dict(checkpoint=fp8_checkpoints[MOE], engine=dict(CPU, **TIGHT, **EXPERTS),
                 calls=[CALL]),
            dict(checkpoint=fp8_checkpoints[MOE], engine=dict(
                CPU, tensor_parallel_size=2, quantization_config=DEQUANTIZE), calls=[CALL])]
    out = tmp_path_factory.mktemp("torchrun") / "results.json"
    run_jobs(jobs, out, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("index", range(len(SPAWNED)))
def test_tp2_matches_transformers_with_preemption_chunks_and_prefix_cache(
        spawned, hf_models, index):
    name, result = SPAWNED[index], spawned[index]
    assert result["outputs"] == [reference(hf_models, name, CALL)]
    stats = result["stats"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_an_error_in_rank_0s_sampling_keeps_the_ranks_in_step(spawned):
    report = spawned[2]["failing_processor"]
    assert report["error"] == "processor failed"
    assert [report["again"]] == spawned[2]["outputs"]


def check_model_call(result: dict, stock) -> None:
    """The model call of ``run_engine.model_call`` against transformers' on the same inputs."""
    ids, mask = left_padded(SCORE["lengths"], stock.config.vocab_size, seed=SCORE["seed"])
    labels = ids.masked_fill(mask == 0, -100)
    ref = stock(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(torch.tensor(result["logits"]), ref.logits, atol=1e-4,
                               rtol=FLOAT32_RTOL)
    torch.testing.assert_close(torch.tensor(result["loss"]), ref.loss, atol=1e-5,
                               rtol=FLOAT32_RTOL)
    torch.testing.assert_close(torch.tensor(result["last"]), stock(ids[:, :7]).logits[:, -1:],
                               atol=1e-4, rtol=FLOAT32_RTOL)
    inner = stock.model(ids[:, :7], output_hidden_states=True)
    torch.testing.assert_close(torch.tensor(result["hidden"]), inner.last_hidden_state,
                               atol=1e-4, rtol=FLOAT32_RTOL)
    torch.testing.assert_close(tuple(torch.tensor(h) for h in result["layers"]),
                               inner.hidden_states, atol=1e-4, rtol=FLOAT32_RTOL)
    mask[1] = 0
    assert result["masked_row"] == stock.generate(ids, attention_mask=mask, do_sample=False,
                                                  max_new_tokens=4).tolist()


def test_the_model_object_generates_and_scores_under_tp(spawned, hf_models):
    """Spawned ranks: the model call (logits, loss, the inner model's hidden states, and
    generate's masked rows, which go through it) equals transformers'."""
    check_model_call(spawned[1]["model_call"], hf_models[SPAWNED[1]])


def test_a_killed_worker_raises_in_the_caller_and_close_returns(spawned):
    report = spawned[1]["killed"]
    assert "worker rank 1" in report["error"] and "SIGKILL" in report["error"], report
    assert report["raise_seconds"] < 10 and report["close_seconds"] < 10
    assert report["worker_reaped"]


def test_ctrl_c_in_the_caller_then_close_leaves_no_worker(spawned):
    report = spawned[0]["interrupted"]
    assert report["interrupted"] and report["workers_reaped"], report
    assert report["close_seconds"] < 10


def test_workers_of_a_killed_caller_exit_on_their_own(spawned):
    def running(pid: int) -> bool:  # a zombie has exited; only its parent may reap it
        try:
            return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return False

    pids = spawned[2]["worker_pids"]
    deadline = time.monotonic() + 10
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, pids))


def test_torchrun_ranks_score_as_transformers(torchrun, hf_models):
    """Every launched rank makes the model call and gets rank 0's result whole."""
    rank0, rank1 = (results[0]["model_call"] for results in torchrun)
    assert rank0 == rank1
    check_model_call(rank0, hf_models["gqa4_untied"])


def test_torchrun_ranks_return_identical_outputs(torchrun, hf_models):
    """Greedy, beam search and greedy verifying prompt-lookup drafts (on rank 0) equal
    transformers; sampled outputs (drawn on rank 0) and per-step scores (its processors') are
    the same on both ranks."""
    rank0, rank1 = (results[0]["outputs"] for results in torchrun)
    assert rank0 == rank1
    greedy, sampled, scored, beams, lookup = rank0
    assert lookup == reference(hf_models, "gqa4_untied", dict(CALL, generate=dict(
        max_new_tokens=40)))
    assert torchrun[0][0]["stats"]["num_accepted_tokens"] > 0
    assert greedy == reference(hf_models, "gqa4_untied", CALL)
    assert beams == reference(hf_models, "gqa4_untied", BEAMS)
    assert sampled != greedy
    assert len(scored["scores"]) == 4 and scored["sequences"] == [row[:-8] for row in greedy]


def test_tp2_qwen3_moe_matches_transformers(torchrun, moe_models):
    """Greedy with preemption, chunked prefill and prefix hits, and beams."""
    rank0, rank1 = (results[1] for results in torchrun)
    assert rank0["outputs"] == rank1["outputs"] == [reference(moe_models, MOE, CALL),
                                                    reference(moe_models, MOE, BEAMS)]
    assert rank0["stats"]["num_preemptions"] > 0, rank0["stats"]


def test_tp2_expert_parallel_qwen3_moe_matches_transformers(torchrun, moe_models):
    """moe_parallel="experts": each rank computes only the pairs routed to its three experts
    and the all-reduce sums the shares; greedy with preemption, chunked prefill and prefix
    hits, and beams."""
    rank0, rank1 = (results[5] for results in torchrun)
    assert rank0["outputs"] == rank1["outputs"] == [reference(moe_models, MOE, CALL),
                                                    reference(moe_models, MOE, BEAMS)]
    assert rank0["stats"]["num_preemptions"] > 0, rank0["stats"]


def test_tp2_fp8_checkpoints_match_tp1(torchrun, fp8_checkpoints):
    """Each rank reads its slices of the FP8 weights and of their scale grids (or, with the
    experts split whole, its experts' weights and grids; or dequantized, its slices of the
    float weights): the tokens are the single-process engine's (greedy and beams, dense;
    greedy with preemption, MoE both ways)."""
    for index, name, calls, load in [(3, "gqa4_untied", [CALL, BEAMS], {}),
                                     (4, MOE, [CALL], {}), (6, MOE, [CALL], {}),
                                     (7, MOE, [CALL], dict(quantization_config=DEQUANTIZE))]:
        rank0, rank1 = (results[index]["outputs"] for results in torchrun)
        with hf_paged.from_pretrained(fp8_checkpoints[name], **CPU, **load) as engine:
            vocab = engine.hf_config.vocab_size
            expected = []
            for call in calls:
                ids, mask = left_padded(call["lengths"], vocab, seed=call["seed"])
                expected.append(engine.generate(ids, attention_mask=mask,
                                                **call["generate"]).tolist())
        assert rank0 == rank1 == expected, (index, name)


def test_data_parallel_under_accelerate(torchrun, hf_models):
    """One engine per launched process (tensor_parallel_size=1): accelerate's process group
    shards nothing; prompts split with split_between_processes, gathered on rank 0."""
    assert torchrun[0][2]["outputs"] == [reference(hf_models, "gqa_tied", DP_CALL, new_only=True)]


def test_tp_size_the_heads_cannot_split_is_refused_before_any_process_starts(checkpoints):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         r"tensor_parallel_size \(3\)"):
        hf_paged.from_pretrained(checkpoints["gqa_tied"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        hf_paged.from_pretrained(checkpoints["gqa_tied"], tensor_parallel_size=0)


def test_moe_parallel_is_checked_before_any_process_starts(moe_checkpoints):
    """An unknown split, and experts that the ranks cannot share out whole, are refused by
    name; without expert parallelism the same ranks split every expert's slice."""
    with pytest.raises(ValueError, match="moe_parallel must be one of"):
        hf_paged.from_pretrained(moe_checkpoints[MOE], moe_parallel="layers")
    config = AutoConfig.from_pretrained(moe_checkpoints["e16_k4_wide"])
    config.num_experts = 6
    check_model(config, 4)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by "
                                         r"tensor_parallel_size \(4\)"):
        check_model(config, 4, expert_parallel=True)
