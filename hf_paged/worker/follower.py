"""The ranks other than 0 of a tensor-parallel group: they run rank 0's steps.

``serve`` is the loop of any such rank, spawned or launched by torchrun. ``main`` is the whole
life of a worker process that ``spawn_ranks`` started: its arguments arrive pickled on stdin
(the ``WorkerSpec``, its rank, the group size, rank 0's store port and pid, the log level); it
builds its shard, serves until rank 0 says stop, and reports its start-up stages, or the
traceback it failed with, to rank 0's store.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from hf_paged.modeling.tp import TensorParallel
from hf_paged.worker.channel import FORWARD, LORA, STEP, StepChannel
from hf_paged.worker.model_call import run_model_call
from hf_paged.worker.ranks import connect_to_store, init_spawned_groups, stage_key
from hf_paged.worker.runner import ModelRunner
from hf_paged.worker.shard import build_shard, device_of

logger = logging.getLogger(__name__)


def serve(runner: ModelRunner, channel: StepChannel, launched: bool = False) -> int:
    """Run rank 0's steps and model calls, and load or unload its adapters (each rank its
    shard), until it sends anything else; return that message's kind. ``launched``: a
    torchrun rank, whose model calls gather their logits on every rank."""
    while True:
        kind, inputs = channel.recv()
        if kind == STEP:
            runner.follow(inputs)
        elif kind == FORWARD:
            run_model_call(runner, channel.recv_object(), launched)
        elif kind == LORA:
            slot, adapter = channel.recv_object()
            if adapter is None:
                runner.lora.unload(slot)
            else:
                runner.load_lora(slot, adapter)
        else:
            return kind


def main() -> None:
    """A spawned rank: build the shard, then follow rank 0's steps until it says stop."""
    spec, rank, size, port, parent_pid, log_level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hf_paged").setLevel(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    store = None
    try:
        device = device_of(spec, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # ranks share the CPU's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        store = connect_to_store(port, size)
        store.set(stage_key(rank, "connecting"), "")
        group, cpu_group = init_spawned_groups(device, store, rank, size)
        tp = TensorParallel(rank, size, group)
        model = build_shard(spec, tp, device)
        store.set(stage_key(rank, "loaded"), "")
        runner = ModelRunner(model, spec.config, spec.max_model_len, tp)
        serve(runner, StepChannel(cpu_group))
        runner.drop_graphs()
        logger.info("rank %d of %d: freeing the process groups", rank, size)
        dist.destroy_process_group()  # with rank 0, which destroys its groups meanwhile
    except BaseException:
        if os.getppid() != parent_pid:
            os._exit(0)  # rank 0 is gone (and the group with it): nothing to report
        try:
            store.set(stage_key(rank, "error"), traceback.format_exc())
        except Exception:
            traceback.print_exc()
        os._exit(1)  # no interpreter teardown: collectives of the others may still be open


def _exit_with_parent(parent_pid: int) -> None:
    """Leave no orphan: a worker whose rank 0 died (even by SIGKILL) exits."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
