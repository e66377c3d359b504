"""The one seam between the host-side engine and the ranks that run the model.

``Executor`` drives a model runner in this process. ``ParallelExecutor`` drives a
tensor-parallel group: rank 0 sends each prepared step to the other ranks, then runs it
itself; it turns a dead worker into a clear error instead of a hang. Under torchrun the other
ranks' engines hold a ``ParallelExecutor`` too, and follow rank 0's steps inside ``run``
until rank 0 sends the results, so that every rank returns the same outputs.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import TYPE_CHECKING

import torch

from hf_paged import quantization
from hf_paged.families import check_model
from hf_paged.modeling.tp import SINGLE
from hf_paged.quantization import fp8
from hf_paged.step import ModelCall, StepPlan, StepResult, WorkerSpec
from hf_paged.worker.backend import resolve_backend
from hf_paged.worker.channel import FORWARD, LORA, RESULTS, STEP
from hf_paged.worker.follower import serve
from hf_paged.worker.launched_step import LaunchedStep
from hf_paged.worker.model_call import run_model_call
from hf_paged.worker.ranks import Ranks, join_launched_ranks, launched_world, spawn_ranks
from hf_paged.worker.runner import ModelRunner
from hf_paged.worker.shard import build_shard

if TYPE_CHECKING:
    from hf_paged.lora.adapter import LoraAdapter

_LIVENESS_CHECK_S = 0.05  # how often a wait on the device looks for dead workers


class Executor:
    """One process: the engine's steps go straight to its model runner.

    What the engine may use: ``launch``/``collect`` a step, ``release`` sequences, the
    transformers-style ``model_call``, ``close``, and the
    facts ``num_blocks``, ``num_state_slots``, ``num_state_snapshots``, ``state_slot_bytes``,
    ``device``, ``dtype``, ``startup_seconds``; ``model`` is the swapped model, for the
    drop-in class to adopt its modules."""

    is_leader = True  # schedules, samples and returns results
    broken: str | None = None  # why a rank can no longer run steps (the device may hang)

    def __init__(self, runner: ModelRunner, load_seconds: float):
        self.runner = runner
        self.model = runner.model
        self.num_blocks = runner.num_blocks
        # A hybrid model's state slots and snapshots (0: none) and the device bytes of each.
        self.num_state_slots = runner.num_state_slots
        self.num_state_snapshots = runner.num_state_snapshots
        self.state_slot_bytes = runner.state_slot_bytes
        self.device, self.dtype = runner.device, runner.dtype
        self.startup_seconds = {"load": load_seconds, **runner.startup_seconds}

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Enqueue a step; the engine holds what this returns until it ``collect``s it."""
        return self.runner.launch(plan)

    def collect(self, step: LaunchedStep) -> StepResult:
        return self.runner.collect(step)

    def release(self, seq_ids: list[int]) -> None:
        self.runner.release(seq_ids)

    def model_call(self, call: ModelCall) -> torch.Tensor:
        """transformers' model forward over padded rows (``ModelCall``): the final hidden
        states, or the logits of the kept positions, on a scratch KV cache (the engine's is
        left alone)."""
        return run_model_call(self.runner, call)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` of every projection it adapts."""
        self.runner.load_lora(slot, adapter)

    def unload_lora(self, slot: int) -> None:
        self.runner.lora.unload(slot)

    @property
    def lora_bytes(self) -> int:
        """Device memory the adapter slots take."""
        return self.runner.lora.nbytes

    def finish_run(self, outcome: object) -> None:
        """End of ``engine.run`` on the leader (its results, or its error as a string):
        nothing to tell in one process."""

    def close(self) -> None:
        """Free the graphs, the KV cache and the weights (whoever else holds them). After a
        rank's death a kernel may wait on it forever (the symmetric-memory all-reduce cannot
        be aborted): then nothing waits for the device, and the memory stays in torch's cache
        for this process."""
        wait = not self.broken
        self.runner.close(synchronize=wait)
        self.model.hf_model.to_empty(device="meta")
        if self.device.type == "cuda" and wait:
            torch.cuda.empty_cache()


class ParallelExecutor(Executor):
    """One rank of a tensor-parallel group; rank 0 is the leader."""

    def __init__(self, runner: ModelRunner, load_seconds: float, ranks: Ranks):
        super().__init__(runner, load_seconds)
        self.ranks = ranks
        self.is_leader = ranks.tp.rank == 0
        self.broken: str | None = None  # why the group can no longer run steps
        # Workers stop when the engine is closed, collected, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _teardown, runner, ranks)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Every rank loads its shard of ``adapter``: spawned ranks from a LORA message (the
        whole adapter, on the host), launched ones from their own ``add_lora`` call."""
        self.runner.lora.check(adapter)  # a refused adapter reaches no rank
        self._send_lora(slot, adapter)
        super().load_lora(slot, adapter)

    def unload_lora(self, slot: int) -> None:
        self._send_lora(slot, None)
        super().unload_lora(slot)

    def _send_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        self._check()
        if self.ranks.launched:
            return
        try:
            self.ranks.channel.send(LORA)
            self.ranks.channel.send_object((slot, adapter and _on_host(adapter)))
        except BaseException as e:
            raise self._failure(e) from e

    def model_call(self, call: ModelCall) -> torch.Tensor | None:
        """Every rank runs ``call``: rank 0 sends it (host tensors); under torchrun each rank
        makes the call itself, the others take rank 0's inputs, and every rank gets the
        result."""
        self._check()
        channel, launched = self.ranks.channel, self.ranks.launched
        try:
            if self.is_leader:
                channel.send(FORWARD)
                channel.send_object(_call_on_host(call))
                return run_model_call(self.runner, call, launched)
            kind, _ = channel.recv()
            if kind != FORWARD:
                raise RuntimeError(f"rank 0 of the tensor-parallel group sent message {kind} "
                                   "where a model call was due")
            return run_model_call(self.runner, channel.recv_object(), launched)
        except BaseException as e:
            raise self._failure(e) from e

    def launch(self, plan: StepPlan) -> LaunchedStep:
        self._check()
        inputs = self.runner.prepare(plan)
        try:
            self.ranks.channel.send(STEP, inputs)
            return self.runner.run(plan, inputs)
        except BaseException as e:
            raise self._failure(e) from e

    def collect(self, step: LaunchedStep) -> StepResult:
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
        kind = serve(self.runner, self.ranks.channel, launched=True)
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
        super().close()

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
            if self.ranks.exited():
                break
            time.sleep(0.01)
        # A killed rank's connections close before its process is reaped (a GPU context takes
        # a while to tear down), so its peers can exit with errors of their own first: wait
        # briefly for the killed one, the cause to name.
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            dead = self.ranks.exited()
            if not dead or any(code < 0 for *_, code in dead):
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


def _on_host(adapter: LoraAdapter) -> LoraAdapter:
    """``adapter`` with its tensors in host memory, to pickle for the other ranks."""
    weights = {key: dataclasses.replace(w, a=w.a.cpu(), b=w.b.cpu())
               for key, w in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


def _call_on_host(call: ModelCall) -> ModelCall:
    """``call`` with its tensors in host memory, to pickle for the other ranks (a device
    tensor would unpickle onto rank 0's device)."""
    keep = call.logits_to_keep
    return dataclasses.replace(
        call, input_ids=call.input_ids.cpu(), attention_mask=call.attention_mask.cpu(),
        position_ids=call.position_ids.cpu(),
        logits_to_keep=keep.cpu() if isinstance(keep, torch.Tensor) else keep)


def _teardown(runner: ModelRunner, ranks: Ranks) -> None:
    """Free the group, after the CUDA graphs: NCCL frees (or aborts) a communicator only once
    no graph holds collectives of it."""
    runner.drop_graphs()
    ranks.close()


def check_spec(spec: WorkerSpec, quantization_config: object = None) -> None:
    """Raise ValueError, naming the setting, for a model or configuration no rank can serve;
    resolve the checkpoint's quantization (or ``quantization_config``'s, quantized on load)
    into ``spec.quantization`` and the attention backend (in ``spec.config``) for the
    device."""
    spec.quantization = quantization.resolve(spec.hf_config, quantization_config)
    if spec.quantization is not None:
        fp8.check_device(spec.quantization, spec.device)
    check_model(spec.hf_config, spec.config.tensor_parallel_size, spec.quantization,
                expert_parallel=spec.config.moe_parallel == "experts")
    spec.config.attention_backend = resolve_backend(
        spec.config.attention_backend, spec.device, spec.config.block_size)


def create_executor(spec: WorkerSpec) -> Executor:
    """Build this process's shard and runner, with the other ranks when there are any.
    ``spec`` has passed ``check_spec``."""
    size = spec.config.tensor_parallel_size
    start = time.perf_counter()
    if size == 1:
        model = build_shard(spec, SINGLE, spec.device)
        load_seconds = time.perf_counter() - start
        return Executor(ModelRunner(model, spec.config, spec.max_model_len), load_seconds)
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    ranks = join_launched_ranks(size, spec.device) if launched_world() else spawn_ranks(size, spec)
    try:
        model = build_shard(spec, ranks.tp, spec.device)
        ranks.wait_for_workers("loaded")
        load_seconds = time.perf_counter() - start
        runner = ModelRunner(model, spec.config, spec.max_model_len, ranks.tp)
    except BaseException:
        ranks.broken = True
        ranks.close()
        raise
    return ParallelExecutor(runner, load_seconds, ranks)
