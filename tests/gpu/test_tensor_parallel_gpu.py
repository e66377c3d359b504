"""Tensor parallelism on CUDA: NCCL ranks on one GPU each, decode CUDA graphs replayed on
every rank, logits gathered on rank 0. float32 tiny checkpoints, so tokens equal stock
transformers' exactly. All but the first test need two GPUs (the CPU suite runs the same paths
over gloo); each multi-process run is a subprocess with a timeout, as in tests/parallel."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from hf_paged.random_checkpoint import random_qwen3
from tests.conftest import TINY_CONFIGS
from tests.parallel.test_tensor_parallel import CALL, SAMPLED, TIGHT, reference, run_jobs

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
NAMES = ["gqa4_untied", "one_kv_head"]


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


@two_gpus
@pytest.mark.parametrize("options", [{}, dict(enforce_eager=True),
                                     dict(disable_custom_all_reduce=True)],
                         ids=["graphs", "eager", "nccl-only"])
def test_tp2_on_two_gpus_matches_transformers(tiny, tmp_path, options):
    """Graphs and eager steps, the all-reduce through symmetric memory or NCCL alone."""
    paths, models = tiny
    jobs = [dict(checkpoint=paths[n], calls=[CALL], engine=dict(
        TIGHT, tensor_parallel_size=2, device="cuda", **options)) for n in NAMES]
    out = tmp_path / "results.json"
    run_jobs(jobs, out)
    for name, result in zip(NAMES, json.loads(out.read_text())):
        assert result["outputs"] == [reference(models, name, CALL)], name


@two_gpus
def test_torchrun_on_two_gpus_identical_on_both_ranks(tiny, tmp_path):
    paths, models = tiny
    jobs = [dict(checkpoint=paths["gqa4_untied"], calls=[CALL, SAMPLED],
                 engine=dict(block_size=16, tensor_parallel_size=2))]
    out = tmp_path / "results.json"
    run_jobs(jobs, out, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    rank0, rank1 = (json.loads(out.with_name(f"results.json.rank{r}").read_text())
                    for r in (0, 1))
    assert rank0[0]["outputs"] == rank1[0]["outputs"]
    assert rank0[0]["outputs"][0] == reference(models, "gqa4_untied", CALL)


@two_gpus
def test_a_killed_gpu_worker_raises_and_close_returns(tiny, tmp_path):
    """NCCL waits forever for a dead rank: the caller must notice the death itself."""
    paths, _ = tiny
    jobs = [dict(checkpoint=paths["gqa4_untied"], calls=[CALL], kill_worker=True,
                 engine=dict(block_size=16, tensor_parallel_size=2, device="cuda"))]
    out = tmp_path / "results.json"
    run_jobs(jobs, out)
    report = json.loads(out.read_text())[0]["killed"]
    assert "SIGKILL" in report["error"] and report["raise_seconds"] < 10, report
    assert report["close_seconds"] < 10 and report["worker_reaped"]
