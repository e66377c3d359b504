"""Tensor-parallel ranks: how a group of them comes to exist, and how it ends.

Two ways to get ranks. From an ordinary process, ``spawn_ranks`` makes the caller rank 0 and
starts ``size - 1`` worker processes (``hf_paged.worker.follower``) that build their shard and
then follow rank 0's steps until told to stop. Under torchrun (``WORLD_SIZE`` set, or a process
group already initialised), ``join_launched_ranks`` groups the launched processes into
consecutive runs of ``size`` ranks; each group is one engine, whose first rank schedules and
samples.

Device collectives (inside the forward) use NCCL on CUDA and gloo on CPU; rank 0's step
messages travel over a separate gloo group (``StepChannel``). A spawned worker reports its
start-up stages, or the traceback it failed with, under ``stage_key`` in rank 0's store.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hf_paged.modeling.tp import TensorParallel
from hf_paged.step import WorkerSpec
from hf_paged.worker.channel import STOP, StepChannel

logger = logging.getLogger(__name__)
# A worker that has not reached the rendezvous by then has failed to start.
_START_TIMEOUT_S = 600

_spawned_groups_open = 0  # engines of this process whose spawned ranks hold the default group


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"


def launched_world() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE), or once a default process
    group exists: the processes are already there and each runs the user's script."""
    if _spawned_groups_open:
        gc.collect()  # an engine nobody holds any more closes when collected
    if _spawned_groups_open:
        raise RuntimeError(
            "this process already runs a tensor-parallel engine with spawned workers; close() "
            "it before loading another with tensor_parallel_size > 1"
        )
    return "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized())


def device_backend(device: torch.device) -> str:
    """The backend of the device collectives on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def stage_key(rank: int, stage: str) -> str:
    """The store key under which spawned worker ``rank`` reports ``stage`` (or "error")."""
    return f"worker{rank}/{stage}"


@dataclass
class Ranks:
    """This process's tensor-parallel group.

    ``tp`` is what the sharded modules see, ``channel`` carries rank 0's messages. Spawned
    mode: ``workers`` are the processes rank 0 started, reporting their start-up stages (or
    the traceback they failed with) through ``store``; the default process group is ours to
    destroy. Torchrun mode (``launched``): every rank runs the user's script; no workers.
    ``broken``: a rank died or a step was cut short, so no collective may be waited on.
    """

    tp: TensorParallel
    channel: StepChannel | None
    groups: list[dist.ProcessGroup]
    launched: bool
    workers: list[subprocess.Popen] = field(default_factory=list)
    store: dist.Store | None = None
    owns_default_group: bool = False
    broken: bool = False

    def dead_worker(self) -> str | None:
        """A description of the spawned workers that have exited, if any: one killed by a
        signal first, with its error report, as the likely cause (a killed rank's peers exit
        with errors of their own once its connections close), then the others."""
        dead = self.exited()
        if not dead:
            return None
        dead.sort(key=lambda item: item[2] >= 0)  # signals (negative codes) first, stable
        rank, proc, code = dead[0]
        key = stage_key(rank, "error")
        report = f"; its error:\n{self.store.get(key).decode()}" if self._has(key) else ""
        others = ", ".join(f"rank {r} (pid {p.pid}) {_how(c)}" for r, p, c in dead[1:])
        others = f" (also: {others})" if others else ""
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {_how(code)}{others}{report}"

    def exited(self) -> list[tuple[int, subprocess.Popen, int]]:
        """(rank, process, exit code) of each spawned worker that has exited."""
        return [(rank, proc, code) for rank, proc in enumerate(self.workers, start=1)
                if (code := proc.poll()) is not None]

    def wait_for_workers(self, stage: str) -> None:
        """Block until every spawned worker reports ``stage``; raise if one fails first."""
        for rank in range(1, len(self.workers) + 1):
            while not self._has(stage_key(rank, stage)):
                if self._has(stage_key(rank, "error")):
                    error = self.store.get(stage_key(rank, "error")).decode()
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{error}")
                dead = self.dead_worker()
                if dead:
                    raise RuntimeError(f"{dead} while starting")
                time.sleep(0.02)

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except RuntimeError:  # the store's server is gone with its process
            return False

    def close(self) -> None:
        """Stop the workers and free the process groups; never waits on a broken group.

        NCCL frees a communicator only with every rank of it at once (its shutdown and abort
        wait for the others), so the ranks tear down together: a spawned worker as soon as
        it reads STOP, while rank 0 does the same here, and only then is it waited for;
        under torchrun every rank's own ``close()``. A group with a dead rank is aborted."""
        if self.workers and not self.broken:
            try:
                self.channel.send(STOP)
            except RuntimeError:
                self.broken = True
        if self.broken:
            self._reap_workers(deadline=time.monotonic())
        logger.info("rank %d of %d: freeing the process groups%s", self.tp.rank, self.tp.size,
                    " (broken)" if self.broken else "")
        nccl = self.tp.group is not None and dist.get_backend(self.tp.group) == "nccl"
        if self.broken and nccl:
            # A collective waiting for a dead rank never finishes: abort instead of destroying.
            dist.distributed_c10d._abort_process_group(self.tp.group)
        else:
            for group in self.groups:
                dist.destroy_process_group(group)
        if self.owns_default_group:
            global _spawned_groups_open
            _spawned_groups_open -= 1
            if dist.is_initialized():
                dist.destroy_process_group()
        self._reap_workers(deadline=time.monotonic() + 30)

    def _reap_workers(self, deadline: float) -> None:
        """Wait for the spawned workers to exit until ``deadline``, then kill them."""
        for proc in self.workers:
            try:
                proc.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def join_launched_ranks(size: int, device: torch.device) -> Ranks:
    """Torchrun mode: groups of ``size`` consecutive launched ranks, one engine each."""
    if not dist.is_initialized():
        dist.init_process_group(device_backend(device))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide the number of launched processes "
            f"({world})"
        )
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        members = list(range(first, first + size))
        device_group = dist.new_group(members, backend=device_backend(device))
        cpu_group = dist.new_group(members, backend="gloo")
        if rank in members:
            mine = device_group, cpu_group
    device_group, cpu_group = mine
    return Ranks(TensorParallel(rank % size, size, device_group), StepChannel(cpu_group),
                 [device_group, cpu_group], launched=True)


def spawn_ranks(size: int, spec: WorkerSpec) -> Ranks:
    """Spawned mode: this process is rank 0 of ``size``; the others start as fresh Python
    processes (not multiprocessing's spawn, which re-runs the caller's main script) and build
    their shards. Raises if a worker fails to start."""
    if spec.device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size ({size}) needs {size} GPUs, {torch.cuda.device_count()} "
            "visible"
        )
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=_START_TIMEOUT_S))
    # The workers import this very package, wherever it was imported from here.
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    workers = []
    for rank in range(1, size):
        proc = subprocess.Popen(
            [sys.executable, "-c", "from hf_paged.worker.follower import main; main()"],
            stdin=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path))
        log_level = logging.getLogger("hf_paged").getEffectiveLevel()  # the worker's too
        proc.stdin.write(pickle.dumps((spec, rank, size, store.port, os.getpid(), log_level)))
        proc.stdin.close()
        workers.append(proc)
    ranks = Ranks(TensorParallel(0, size), None, [], launched=False, workers=workers,
                  store=store, owns_default_group=True)
    try:
        ranks.wait_for_workers("connecting")  # imports done: the rendezvous will not stall
        group, cpu_group = init_spawned_groups(spec.device, store, 0, size)
    except BaseException:
        ranks.broken, ranks.owns_default_group = True, False
        ranks.close()
        raise
    ranks.tp, ranks.channel, ranks.groups = (
        TensorParallel(0, size, group), StepChannel(cpu_group), [cpu_group])
    global _spawned_groups_open
    _spawned_groups_open += 1
    return ranks


def connect_to_store(port: int, size: int) -> dist.Store:
    """A spawned worker: rank 0's store, through which it reports and meets the others."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=False,
                         timeout=timedelta(seconds=_START_TIMEOUT_S))


def init_spawned_groups(device: torch.device, store: dist.Store, rank: int,
                        size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """A spawned group's rendezvous, on every rank: the default group (device collectives)
    and a gloo group for step messages."""
    dist.init_process_group(device_backend(device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=_START_TIMEOUT_S))
    return dist.group.WORLD, dist.new_group(backend="gloo")
