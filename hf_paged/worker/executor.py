"""The one seam between the host-side engine and the ranks that run the model.

``Executor`` drives a model runner in this process. ``ParallelExecutor`` drives a
tensor-parallel group: rank 0 sends each prepared step to the other ranks, then runs it
itself; it turns a dead worker into a clear error instead of a hang. Under torchrun the other
ranks' engines hold a ``ParallelExecutor`` too, and follow rank 0's steps inside ``run``
until rank 0 sends the results, so that every rank returns the same outputs.
"""

from __future__ import annotations

import os
import time
import weakref

import torch

from hf_paged.engine.scheduler import ScheduledBatch
from hf_paged.engine.sequence import Sequence
from hf_paged.modeling.tp import SINGLE
from hf_paged.worker.model_runner import LaunchedStep, ModelRunner
from hf_paged.worker.parallel import (
    RESULTS,
    STEP,
    Ranks,
    RunnerSpec,
    join_launched_ranks,
    launched_world,
    serve,
    spawn_ranks,
)

_LIVENESS_CHECK_S = 0.05  # how often a wait on the device looks for dead workers


class Executor:
    """One process: the engine's steps go straight to its model runner."""

    is_leader = True  # schedules, samples and returns results
    broken: str | None = None  # why a rank can no longer run steps (the device may hang)

    def __init__(self, runner: ModelRunner, load_seconds: float):
        self.runner = runner
        self.startup_seconds = {"load": load_seconds, **runner.startup_seconds}

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        return self.runner.launch(batch)

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[tuple]]:
        return self.runner.collect(step)

    def release(self, seqs: list[Sequence]) -> None:
        self.runner.release(seqs)

    def finish_run(self, outcome: object) -> None:
        """End of ``engine.run`` on the leader (its results, or its error as a string):
        nothing to tell in one process."""

    def close(self) -> None:
        """Nothing to stop in one process."""


class ParallelExecutor(Executor):
    """One rank of a tensor-parallel group; rank 0 is the leader."""

    def __init__(self, runner: ModelRunner, load_seconds: float, ranks: Ranks):
        super().__init__(runner, load_seconds)
        self.ranks = ranks
        self.is_leader = ranks.tp.rank == 0
        self.broken: str | None = None  # why the group can no longer run steps
        # Workers stop when the engine is closed, collected, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _teardown, runner, ranks)

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        self._check()
        inputs = self.runner.prepare(batch)
        try:
            self.ranks.channel.send(STEP, inputs)
            return self.runner.run(batch, inputs)
        except BaseException as e:
            raise self._failure(e) from e

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[tuple]]:
        # On CUDA, a collective waiting for a dead rank never ends: poll, looking for one.
        next_check = time.monotonic() + _LIVENESS_CHECK_S
        while step.done is not None and not step.done.query():
            if time.monotonic() > next_check:
                self._check()
                next_check = time.monotonic() + _LIVENESS_CHECK_S
        return self.runner.collect(step)

    def finish_run(self, outcome: object) -> None:
        """Torchrun mode: the other ranks' ``follow_run`` returns ``outcome`` (or raises)."""
        if not self.ranks.launched or self.broken:
            return
        self.ranks.channel.send(RESULTS)
        self.ranks.channel.send_object(outcome)

    def follow_run(self) -> object:
        """Torchrun mode, ranks other than 0: run rank 0's steps until its outcome arrives."""
        kind = serve(self.runner, self.ranks.channel)
        if kind != RESULTS:
            raise RuntimeError(f"rank 0 of the tensor-parallel group sent message {kind} "
                               "where results were due")
        outcome = self.ranks.channel.recv_object()
        if isinstance(outcome, str):
            raise RuntimeError(f"generation failed on rank 0 of the tensor-parallel group: "
                               f"{outcome}")
        return outcome

    def close(self) -> None:
        self._finalizer()
        if self.ranks.broken and not self.broken:  # found only by the teardown
            self.broken = "a rank failed before the engine was closed"

    def _check(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this engine has been closed")
        if self.broken is None:
            dead = self.ranks.dead_worker()
            if dead:
                self._break(f"{dead}; this engine can no longer generate: close() it")
        if self.broken:
            raise RuntimeError(self.broken)

    def _failure(self, error: BaseException) -> BaseException:
        """What to raise for an error in the middle of a step."""
        deadline = time.monotonic() + 2  # a killed peer's socket may close before it is reaped
        while self.ranks.workers and time.monotonic() < deadline:
            if self.ranks.dead_worker():
                break
            time.sleep(0.01)
        try:
            self._check()
        except RuntimeError as dead:
            return dead
        if not isinstance(error, Exception):  # e.g. Ctrl-C: the ranks may be mid-step
            self._break("a tensor-parallel step was interrupted; close() this engine")
        return error

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.ranks.broken = True


def _teardown(runner: ModelRunner, ranks: Ranks) -> None:
    """Free the group, after the CUDA graphs: NCCL frees (or aborts) a communicator only once
    no graph holds collectives of it."""
    runner.drop_graphs()
    ranks.close()


def resolve_device(device: torch.device | str | None) -> torch.device:
    """CUDA when available; under a launcher the GPU of the local rank."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) % torch.cuda.device_count() if local else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


def create_executor(spec: RunnerSpec) -> Executor:
    """Build this process's shard and runner, with the other ranks when there are any."""
    size = spec.config.tensor_parallel_size
    start = time.perf_counter()
    if size == 1:
        model = spec.build(SINGLE, spec.device)
        load_seconds = time.perf_counter() - start
        return Executor(ModelRunner(model, spec.config, spec.max_model_len), load_seconds)
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    ranks = join_launched_ranks(size, spec.device) if launched_world() else spawn_ranks(size, spec)
    try:
        model = spec.build(ranks.tp, spec.device)
        ranks.wait_for_workers("loaded")
        load_seconds = time.perf_counter() - start
        runner = ModelRunner(model, spec.config, spec.max_model_len, ranks.tp)
    except BaseException:
        ranks.broken = True
        ranks.close()
        raise
    return ParallelExecutor(runner, load_seconds, ranks)
