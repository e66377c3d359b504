"""Tensor-parallel ranks: their process groups, the worker processes rank 0 spawns, torchrun
mode, and the channel that carries each step's inputs from rank 0 to the other ranks.

Two ways to get ranks. From an ordinary process, ``spawn_ranks`` makes the caller rank 0 and
starts ``size - 1`` worker processes that build their shard and then follow rank 0's steps
until told to stop. Under torchrun (``WORLD_SIZE`` set, or a process group already
initialised), ``join_launched_ranks`` groups the launched processes into consecutive runs of
``size`` ranks; each group is one engine, whose first rank schedules and samples.

Device collectives (inside the forward) use NCCL on CUDA and gloo on CPU; rank 0's step
messages travel over a separate gloo group, in host memory, so they cross machines too.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from hf_paged.config import EngineConfig
from hf_paged.cuda_graphs import capture_graph
from hf_paged.kernels.launch import hash_triton_in_background
from hf_paged.modeling.all_reduce import SymmetricAllReduce
from hf_paged.modeling.swap import build_model
from hf_paged.modeling.tp import TensorParallel
from hf_paged.step import StepInputs
from hf_paged.worker.runner import ModelRunner

logger = logging.getLogger(__name__)
STEP, RESULTS, STOP = 1, 2, 3  # message kinds
# A worker that has not reached the rendezvous by then has failed to start.
_START_TIMEOUT_S = 600
# The symmetric all-reduce buffer holds this many tokens' hidden states, as many as the
# largest prefill graph computes; longer steps move enough bytes for NCCL's bandwidth.
_SYMMETRIC_ALL_REDUCE_TOKENS = 2048


_spawned_groups_open = 0  # engines of this process whose spawned ranks hold the default group


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
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class RunnerSpec:
    """What a rank needs to build its shard and model runner (sent to spawned workers)."""

    hf_config: PretrainedConfig
    checkpoint: str
    dtype: torch.dtype
    device: torch.device  # rank 0's; rank r of a spawned group takes the r-th GPU after it
    config: EngineConfig
    max_model_len: int

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index + rank) % torch.cuda.device_count())

    def build(self, tp: TensorParallel, device: torch.device):
        """This rank's model shard; the runner comes after every rank has loaded. Every rank
        calls it at the same point: on CUDA it first maps the ranks' all-reduce buffers."""
        if device.type == "cuda" and tp.size > 1 and not self.config.disable_custom_all_reduce:
            tp = self._with_symmetric_all_reduce(tp, device)
        logger.info("rank %d of %d: loading the weights on %s", tp.rank, tp.size, device)
        if device.type == "cuda":
            hash_triton_in_background()
        return build_model(self.hf_config, self.checkpoint, self.dtype, device,
                           self.config.attention_backend, self.max_model_len, tp)

    def _with_symmetric_all_reduce(self, tp: TensorParallel, device: torch.device):
        """``tp`` with the symmetric-memory all-reduce, once every rank has set it up and
        summed a test tensor right, eagerly and replayed from a CUDA graph; else ``tp`` (NCCL
        alone), on every rank alike."""
        if not tp.min_over_ranks(int(not SymmetricAllReduce.set_up_before(tp.group)), device):
            logger.info("rank %d of %d: all-reduce through NCCL alone (symmetric memory was set "
                        "up in this process for an earlier group of the same name)",
                        tp.rank, tp.size)
            return tp
        tokens = min(self.config.max_num_batched_tokens, _SYMMETRIC_ALL_REDUCE_TOKENS)
        fast, error = None, None
        try:
            fast = SymmetricAllReduce(tp.group, device, self.dtype,
                                      tokens * self.hf_config.hidden_size)
            x = torch.empty(16, dtype=self.dtype, device=device)
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
                fast.tune(self.hf_config.hidden_size)
            return dataclasses.replace(tp, fast_all_reduce=fast)
        logger.warning("rank %d of %d: all-reduce through NCCL alone (symmetric memory %s)",
                       tp.rank, tp.size, f"failed: {error}" if error else "failed on a rank")
        return tp


class StepChannel:
    """Rank 0's messages to the other ranks of its group: a header of ten int64 (kind, then
    the sizes ``StepInputs`` needs) and, for a step, one flat int64 payload."""

    def __init__(self, cpu_group: dist.ProcessGroup):
        self.group = cpu_group
        self.header = torch.zeros(10, dtype=torch.long)

    def send(self, kind: int, inputs: StepInputs | None = None) -> None:
        self.header.zero_()
        self.header[0] = kind
        if inputs is not None:
            t = inputs.tables
            self.header[1:] = torch.tensor([
                len(inputs.ids), len(inputs.seq_lens), len(inputs.logits_rows), t.shape[1],
                inputs.max_query_len, inputs.graph_bs, inputs.shared, len(inputs.block_copies),
                inputs.num_drawn])
        self._broadcast(self.header)
        if inputs is not None:
            payload = np.concatenate([
                inputs.ids, inputs.src, inputs.positions, inputs.slots, inputs.cu_seqlens,
                inputs.seq_lens, inputs.logits_rows, inputs.tables.ravel(),
                np.asarray(inputs.block_copies, dtype=np.int64).ravel()]).astype(np.int64)
            self._broadcast(torch.from_numpy(payload))

    def recv(self) -> tuple[int, StepInputs | None]:
        self._broadcast(self.header)
        kind, n, b, r, width, max_query_len, graph_bs, shared, c, drawn = self.header.tolist()
        if kind != STEP:
            return kind, None
        payload = torch.empty(4 * n + 2 * b + 1 + r + b * width + 2 * c, dtype=torch.long)
        self._broadcast(payload)
        parts = np.split(payload.numpy(), np.cumsum([n, n, n, n, b + 1, b, r, b * width]))
        lists = [p.tolist() for p in parts[:7]]
        tables = parts[7].astype(np.int32).reshape(b, width)
        copies = [tuple(pair) for pair in parts[8].reshape(c, 2).tolist()]
        return kind, StepInputs(*lists[:6], tables, lists[6], max_query_len, graph_bs, shared,
                                copies, drawn)

    def send_object(self, obj: object) -> None:
        dist.broadcast_object_list([obj], group=self.group, group_src=0)

    def recv_object(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _broadcast(self, x: torch.Tensor) -> None:
        dist.broadcast(x, group=self.group, group_src=0)


def serve(runner: ModelRunner, channel: StepChannel) -> int:
    """A rank other than 0: run rank 0's steps until it sends anything else; return its kind."""
    while True:
        kind, inputs = channel.recv()
        if kind != STEP:
            return kind
        runner.follow(inputs)


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
        """A description of the first spawned worker that has exited, if any."""
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is None:
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
            key = f"worker{rank}/error"
            report = f"; its error:\n{self.store.get(key).decode()}" if self._has(key) else ""
            return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}{report}"
        return None

    def wait_for_workers(self, stage: str) -> None:
        """Block until every spawned worker reports ``stage``; raise if one fails first."""
        for rank in range(1, len(self.workers) + 1):
            while not self._has(f"worker{rank}/{stage}"):
                if self._has(f"worker{rank}/error"):
                    error = self.store.get(f"worker{rank}/error").decode()
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


def spawn_ranks(size: int, spec: RunnerSpec) -> Ranks:
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
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    workers = []
    for rank in range(1, size):
        proc = subprocess.Popen(
            [sys.executable, "-c", "from hf_paged.worker.parallel import worker; worker()"],
            stdin=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path))
        log_level = logging.getLogger("hf_paged").getEffectiveLevel()  # the worker's too
        proc.stdin.write(pickle.dumps((spec, rank, size, store.port, os.getpid(), log_level)))
        proc.stdin.close()
        workers.append(proc)
    ranks = Ranks(TensorParallel(0, size), None, [], launched=False, workers=workers,
                  store=store, owns_default_group=True)
    try:
        ranks.wait_for_workers("connecting")  # imports done: the rendezvous will not stall
        group, cpu_group = _init_groups(spec.device, store, 0, size)
    except BaseException:
        ranks.broken, ranks.owns_default_group = True, False
        ranks.close()
        raise
    ranks.tp, ranks.channel, ranks.groups = (
        TensorParallel(0, size, group), StepChannel(cpu_group), [cpu_group])
    global _spawned_groups_open
    _spawned_groups_open += 1
    return ranks


def _init_groups(device, store, rank, size):
    """The default group (device collectives) and a gloo group for step messages."""
    dist.init_process_group(device_backend(device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=_START_TIMEOUT_S))
    return dist.group.WORLD, dist.new_group(backend="gloo")


def worker() -> None:
    """A spawned rank (its arguments arrive pickled on stdin): build the shard, then follow
    rank 0's steps until it says stop. Start-up stages and errors go to rank 0's store."""
    spec, rank, size, port, parent_pid, log_level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hf_paged").setLevel(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    store = None
    try:
        device = spec.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # ranks share the CPU's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                              timeout=timedelta(seconds=_START_TIMEOUT_S))
        store.set(f"worker{rank}/connecting", "")
        group, cpu_group = _init_groups(device, store, rank, size)
        tp = TensorParallel(rank, size, group)
        model = spec.build(tp, device)
        store.set(f"worker{rank}/loaded", "")
        runner = ModelRunner(model, spec.config, spec.max_model_len, tp)
        serve(runner, StepChannel(cpu_group))
        runner.drop_graphs()
        logger.info("rank %d of %d: freeing the process groups", rank, size)
        dist.destroy_process_group()  # with rank 0, which destroys its groups meanwhile
    except BaseException:
        if os.getppid() != parent_pid:
            os._exit(0)  # rank 0 is gone (and the group with it): nothing to report
        try:
            store.set(f"worker{rank}/error", traceback.format_exc())
        except Exception:
            traceback.print_exc()
        os._exit(1)  # no interpreter teardown: collectives of the others may still be open


def _exit_with_parent(parent_pid: int) -> None:
    """Leave no orphan: a worker whose rank 0 died (even by SIGKILL) exits."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
