"""Tensor parallelism on CUDA: NCCL ranks on one GPU each, decode CUDA graphs replayed on
every rank, logits gathered on rank 0, at sizes 2 and 4 (four ranks replicate the tiny
checkpoints' two and one KV heads). float32 tiny checkpoints, so tokens equal stock
transformers' exactly; a KV cache too small for the batch (preemption, prefix-cache hits on
resumption) and a 16-token step budget (chunked prefill). All but the first test need two or
four GPUs (the CPU suite runs the same paths over gloo); each multi-process run is a
subprocess that must end within ``TIMEOUT_S`` (a hang prints its stacks), as in
tests/parallel."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from hf_paged.random_checkpoint import random_qwen3
from tests.conftest import TINY_CONFIGS
from tests.parallel.test_tensor_parallel import (
    CALL,
    SAMPLED,
    TIGHT,
    check_model_call,
    reference,
    run_jobs,
)

pytestmark = pytest.mark.gpu
NAMES = ["gqa4_untied", "one_kv_head"]
TIMEOUT_S = 150  # a tiny checkpoint's run takes well under a minute on GPUs


def on_gpus(size: int, *values, name: str = ""):
    """A parameter set for ``size`` ranks, skipped on a machine with fewer GPUs."""
    return pytest.param(size, *values, id=f"tp{size}{name}", marks=pytest.mark.skipif(
        torch.cuda.device_count() < size, reason=f"needs {size} GPUs"))


SIZES = [on_gpus(2), on_gpus(4)]
GRAPHS, EAGER, NCCL = {}, dict(enforce_eager=True), dict(disable_custom_all_reduce=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    paths, models = {}, {}
    for name in NAMES:
        path = str(tmp_path_factory.mktemp(name))
        model = random_qwen3(Qwen3Config(**TINY_CONFIGS[name], dtype="float32"), seed=0)
        model.save_pretrained(path)
        paths[name], models[name] = path, model.eval()
    return paths, models


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="for machines with one GPU")
def test_more_ranks_than_gpus_is_refused_before_any_process_starts(tiny):
    import hf_paged

    paths, _ = tiny
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) needs 2 GPUs, 1 visible"):
        hf_paged.from_pretrained(paths["gqa4_untied"], tensor_parallel_size=2, device="cuda")


@pytest.mark.parametrize("size,options", [
    on_gpus(2, GRAPHS, name="-graphs"), on_gpus(2, EAGER, name="-eager"),
    on_gpus(2, NCCL, name="-nccl-only"), on_gpus(4, GRAPHS, name="-graphs"),
    on_gpus(4, NCCL, name="-nccl-only")])
def test_tp_on_gpus_matches_transformers(tiny, tmp_path, size, options):
    """Graphs and eager steps, the all-reduce through symmetric memory or NCCL alone."""
    paths, models = tiny
    jobs = [dict(checkpoint=paths[n], calls=[CALL], engine=dict(
        TIGHT, tensor_parallel_size=size, device="cuda", **options)) for n in NAMES]
    out = tmp_path / "results.json"
    run_jobs(jobs, out, timeout=TIMEOUT_S)
    for name, result in zip(NAMES, json.loads(out.read_text())):
        assert result["outputs"] == [reference(models, name, CALL)], name
        stats = result["stats"]
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
        assert stats["num_free_blocks"] == stats["num_blocks"], stats


@pytest.mark.parametrize("size", SIZES)
def test_torchrun_on_gpus_identical_on_every_rank(tiny, tmp_path, size):
    """Generate, and the model call (loaded as transformers' model object), on every rank."""
    paths, models = tiny
    jobs = [dict(checkpoint=paths["gqa4_untied"], calls=[CALL, SAMPLED], model_object=True,
                 engine=dict(block_size=16, tensor_parallel_size=size))]
    out = tmp_path / "results.json"
    run_jobs(jobs, out, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                         str(size)], timeout=TIMEOUT_S)
    ranks = [json.loads(out.with_name(f"results.json.rank{r}").read_text())
             for r in range(size)]
    assert all(rank[0]["outputs"] == ranks[0][0]["outputs"] for rank in ranks[1:])
    assert ranks[0][0]["outputs"][0] == reference(models, "gqa4_untied", CALL)
    # the model call: every rank makes it and gets the logits all-gathered over NCCL
    assert all(rank[0]["model_call"] == ranks[0][0]["model_call"] for rank in ranks[1:])
    check_model_call(ranks[0][0]["model_call"], models["gqa4_untied"])


@pytest.mark.parametrize("size,options", [
    on_gpus(2, GRAPHS, name="-symmetric-memory"), on_gpus(2, NCCL, name="-nccl-only"),
    on_gpus(4, GRAPHS, name="-symmetric-memory")])
def test_a_killed_gpu_worker_raises_and_close_returns(tiny, tmp_path, size, options):
    """A collective waits forever for a dead rank (NCCL's until aborted, the symmetric-memory
    all-reduce's spin for good): the caller must notice the death itself, and neither the
    engine's close nor the process's exit may wait on the device."""
    paths, _ = tiny
    jobs = [dict(checkpoint=paths["gqa4_untied"], calls=[CALL], kill_worker=True,
                 engine=dict(block_size=16, tensor_parallel_size=size, device="cuda",
                             **options))]
    out = tmp_path / "results.json"
    run_jobs(jobs, out, timeout=TIMEOUT_S)
    report = json.loads(out.read_text())[0]["killed"]
    assert "SIGKILL" in report["error"] and report["raise_seconds"] < 10, report
    assert report["close_seconds"] < 10 and report["worker_reaped"]
