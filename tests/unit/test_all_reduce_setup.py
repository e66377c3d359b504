"""The tensor-parallel all-reduce's two paths: a tensor the symmetric-memory path declines goes
to the process group, and that path is taken only once a test sum came out right (its CUDA
kernels run in the GPU tests; here stand-ins play them)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen3Config

from hf_paged.config import EngineConfig
from hf_paged.modeling import all_reduce
from hf_paged.modeling.tp import TensorParallel
from hf_paged.step import WorkerSpec
from hf_paged.worker import shard
from tests.conftest import TINY_CONFIGS


def test_all_reduce_takes_the_fast_path_unless_it_declines(monkeypatch):
    to_group = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group: to_group.append(x))

    def fits(x):
        return x * 2 if x.numel() <= 4 else None

    tp = TensorParallel(0, 2, None, fast_all_reduce=fits)
    small, big = torch.ones(4), torch.ones(5)
    assert torch.equal(tp.all_reduce(small), torch.full((4,), 2.0))
    assert tp.all_reduce(big) is big
    assert to_group == [big]
    TensorParallel(fast_all_reduce=fits).all_reduce(big)  # one rank: nothing to reduce
    assert to_group == [big]


class _Summing:
    """Stands in for SymmetricAllReduce on one rank: the sum of one rank is itself."""

    def __init__(self, group, device, dtype, numel):
        self.numel = numel

    def __call__(self, x):
        return x.clone()

    @staticmethod
    def set_up_before(group):
        return False


class _Wrong(_Summing):
    def __call__(self, x):
        return x + 1


class _Failing(_Summing):
    def __init__(self, *args):
        raise RuntimeError("no symmetric memory here")


def _spec() -> WorkerSpec:
    return WorkerSpec(Qwen3Config(**TINY_CONFIGS["gqa_tied"]), "", torch.float32,
                      torch.device("cpu"), EngineConfig(max_num_batched_tokens=64), 64)


@pytest.mark.parametrize("stand_in,taken", [(_Summing, True), (_Wrong, False),
                                            (_Failing, False)])
def test_symmetric_all_reduce_is_used_only_once_it_sums_right(monkeypatch, caplog, stand_in,
                                                              taken):
    monkeypatch.setattr(shard, "SymmetricAllReduce", stand_in)
    spec = _spec()
    tp = TensorParallel(0, 1)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        out = shard._with_symmetric_all_reduce(spec, tp, torch.device("cpu"))
    assert (out.fast_all_reduce is not None) == taken
    if taken:
        assert out.fast_all_reduce.numel == 64 * spec.hf_config.hidden_size
    else:
        assert out is tp and "NCCL alone" in caplog.text


def test_a_group_name_set_up_before_in_this_process_keeps_nccl(monkeypatch, caplog):
    """torch keeps a group name's symmetric-memory store for the life of the process, so a
    later group of the same name (a second engine) must not rendezvous again."""
    monkeypatch.setattr(all_reduce, "_GROUP_NAMES_SET_UP", set())
    spec, cpu = _spec(), torch.device("cpu")
    tp = TensorParallel(0, 1, SimpleNamespace(group_name="0"))
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert shard._with_symmetric_all_reduce(spec, tp, cpu) is tp  # no symmetric memory on CPU
        assert "does not support device type cpu" in caplog.text
        caplog.clear()
        assert shard._with_symmetric_all_reduce(spec, tp, cpu) is tp
    assert "earlier group of the same name" in caplog.text
    other = TensorParallel(0, 1, SimpleNamespace(group_name="1"))
    assert not all_reduce.SymmetricAllReduce.set_up_before(other.group)


def test_the_fastest_algorithm_that_summed_right_serves_each_message_size():
    micros = {2048: {"one_shot": 6.0, "two_shot": 9.0, "nccl": 7.0},
              262144: {"one_shot": 12.0, "nccl": 11.0},  # two-shot summed wrong
              4 << 20: {"one_shot": 50.0, "two_shot": 30.0, "nccl": 28.0}}
    choices = all_reduce.fastest(micros)
    assert choices == [(2048, "one_shot"), (262144, "nccl"), (4 << 20, "nccl")]
    assert all_reduce.fastest({64: {}}) == [(64, "nccl")]
    fast = all_reduce.SymmetricAllReduce.__new__(all_reduce.SymmetricAllReduce)
    fast.group, fast.choices = SimpleNamespace(size=lambda: 4), []
    # Untuned (the set-up's test sum): one-shot.
    assert [fast.algorithm(n) for n in (16, 262144, 262160)] == ["one_shot"] * 3
    fast.choices = choices
    assert [fast.algorithm(n) for n in (16, 2048, 2064, 4 << 20, 8 << 20)] == [
        "one_shot", "one_shot", "nccl", "nccl", "nccl"]
    fast.buffer = torch.empty(1 << 20, dtype=torch.float32)
    x = torch.ones(1024)  # 4 KiB: NCCL's size, so left to the process group untouched
    assert fast(x) is None and torch.equal(x, torch.ones(1024))
