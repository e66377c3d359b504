"""A rank's model shard: which device it runs on, and its weights loaded there.

On CUDA with more than one rank, the shard's all-reduce goes through PyTorch's symmetric memory
(``SymmetricAllReduce``) when every rank has set it up and summed a test tensor right; else
through NCCL alone, on every rank alike. Every rank of a group builds its shard at the same
point, since that set-up is itself a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from hf_paged.cuda_graphs import capture_graph
from hf_paged.families.build import build_model
from hf_paged.kernels.launch import hash_triton_in_background
from hf_paged.modeling.all_reduce import SymmetricAllReduce
from hf_paged.modeling.tp import TensorParallel
from hf_paged.step import WorkerSpec

logger = logging.getLogger(__name__)
# The symmetric all-reduce buffer holds this many tokens' hidden states, as many as the
# largest prefill graph computes under tensor parallelism; longer steps move enough bytes for
# NCCL's bandwidth.
SYMMETRIC_ALL_REDUCE_TOKENS = 2048


def device_of(spec: WorkerSpec, rank: int) -> torch.device:
    """Rank ``rank``'s device in a spawned group: the ``rank``-th GPU after rank 0's."""
    if spec.device.type != "cuda":
        return spec.device
    return torch.device("cuda", (spec.device.index + rank) % torch.cuda.device_count())


def build_shard(spec: WorkerSpec, tp: TensorParallel, device: torch.device) -> torch.nn.Module:
    """This rank's model shard; the runner comes after every rank has loaded. Every rank
    calls it at the same point: on CUDA it first maps the ranks' all-reduce buffers."""
    if device.type == "cuda" and tp.size > 1 and not spec.config.disable_custom_all_reduce:
        tp = _with_symmetric_all_reduce(spec, tp, device)
    tp = dataclasses.replace(
        tp, expert_parallel=tp.size > 1 and spec.config.moe_parallel == "experts")
    logger.info("rank %d of %d: loading the weights on %s", tp.rank, tp.size, device)
    if device.type == "cuda":
        hash_triton_in_background()
    start = time.perf_counter()
    model = build_model(spec.hf_config, spec.checkpoint, spec.dtype, device,
                        spec.config.attention_backend, spec.max_model_len, tp,
                        spec.quantization)
    # Per rank: a rank that loads far slower than the others holds every rank's start-up.
    gib = sum(p.numel() * p.element_size() for p in model.hf_model.parameters()) / 2**30
    logger.info("rank %d of %d: %.2f GiB of weights loaded in %.1f s", tp.rank, tp.size, gib,
                time.perf_counter() - start)
    return model


def _with_symmetric_all_reduce(spec: WorkerSpec, tp: TensorParallel,
                               device: torch.device) -> TensorParallel:
    """``tp`` with the symmetric-memory all-reduce, once every rank has set it up and summed a
    test tensor right, eagerly and replayed from a CUDA graph; else ``tp`` (NCCL alone), on
    every rank alike."""
    if not tp.min_over_ranks(int(not SymmetricAllReduce.set_up_before(tp.group)), device):
        logger.info("rank %d of %d: all-reduce through NCCL alone (symmetric memory was set "
                    "up in this process for an earlier group of the same name)",
                    tp.rank, tp.size)
        return tp
    tokens = min(spec.config.max_num_batched_tokens, SYMMETRIC_ALL_REDUCE_TOKENS)
    fast, error = None, None
    try:
        fast = SymmetricAllReduce(tp.group, device, spec.dtype,
                                  tokens * spec.hf_config.hidden_size)
        x = torch.empty(16, dtype=spec.dtype, device=device)
        expected = tp.size * (tp.size + 1) // 2

        def sums_right(run) -> bool:
            x.fill_(tp.rank + 1)
            out = run()
            return out is not None and bool((out == expected).all())

        ok = sums_right(lambda: fast(x))
        if ok and device.type == "cuda":  # always, but for the unit tests' CPU stand-ins
            graph, captured = capture_graph(lambda: fast(x))

            def replayed():
                graph.replay()
                return captured

            ok = sums_right(replayed)
            del graph
    except Exception as e:  # e.g. a torch without symmetric memory
        ok, error = False, e
    if tp.min_over_ranks(int(ok), device):
        if device.type == "cuda":  # always, but for the unit tests' CPU stand-ins
            fast.tune(spec.hf_config.hidden_size)
        return dataclasses.replace(tp, fast_all_reduce=fast)
    logger.warning("rank %d of %d: all-reduce through NCCL alone (symmetric memory %s)",
                   tp.rank, tp.size, f"failed: {error}" if error else "failed on a rank")
    return tp
