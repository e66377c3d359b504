"""What transformers' server holds with ``--engine-process``: a model object and a
continuous-batching manager whose engine runs in another process (``engine_process``).

``RemoteModel`` is what transformers' ``ModelManager`` loads in its place: the engine
process's config and generation config, and ``init_continuous_batching``. ``RemoteManager``
is transformers' ``ContinuousBatchingManager`` with its plumbing kept where the server reads it
(``register_result_handler``, the ``OutputRouter``, ``background_thread_status``) and its
requests sent to the engine process; a thread turns the tokens that come back into
transformers' ``GenerationOutput`` objects (one token list a request, shared as the engine
loop shares it) and delivers them through the router, on the server's event loop (none for a
stream whose last one still waits there: ``OutputDelivery``).

With ``--data-parallel-size N`` the model is N engine processes (``data_parallel``), replica
``i`` on GPUs ``[i * tp, (i + 1) * tp)``: each request goes to the live replica with the
fewest outstanding requests (sent and not finished), ``stats`` and ``times`` are their sums.
A replica that dies fails its own requests with its name; the server goes on with the rest,
and is unhealthy once none is left.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

import torch
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus,
    ContinuousBatchingManager,
    OutputRouter,
)
from transformers.generation.continuous_batching.requests import (
    GenerationOutput,
    RequestStatus,
)

from hf_paged.integrations.data_parallel_replicas import start_replicas
from hf_paged.integrations.engine_process import EngineProcess, ProcessDied
from hf_paged.integrations.output_delivery import OutputDelivery
from hf_paged.integrations.request_times import RequestTimes

logger = logging.getLogger(__name__)


class RemoteEngine:
    """What ``/health`` and ``/metrics`` read of an engine (``serve_metrics``), asked of the
    engine processes (the live ones' sums)."""

    def __init__(self, processes: list[EngineProcess]):
        self.processes = processes
        self.stopped = False

    @property
    def closed(self) -> bool:
        """Stopped, or every process exited (``/health`` then reports the loop's fatal
        error)."""
        return self.stopped or all(p.process.poll() is not None for p in self.processes)

    def _read(self) -> list[tuple]:
        """(stats, times, broken) of each live process."""
        read = []
        for process in self.processes:
            try:
                read.append(process.call("stats"))
            except ProcessDied:
                continue
        return read

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for stats, _, _ in self._read():
            for name, value in stats.items():
                total[name] = total.get(name, 0) + value
        return total

    def load_loras(self, loras: dict[str, str]) -> None:
        """Load LoRA adapters from their folders in every engine process
        (``named.load_loras``); an ``AdapterSpecError`` naming a bad one."""
        from hf_paged.lora.named import AdapterSpecError

        for process in self.processes:
            problem = process.call("load_loras", loras, timeout=600.0)
            if problem is not None:
                raise AdapterSpecError(problem)

    @property
    def broken(self) -> str | None:
        """Why no process can generate (a tensor-parallel worker died in each, or it
        exited); None while one can."""
        read = self._read()
        if read and any(broken is None for _, _, broken in read):
            return None
        return "; ".join([b for _, _, b in read] + [p.died for p in self.processes if p.died])

    @property
    def times(self) -> RequestTimes | None:
        read = [times for _, times, _ in self._read() if times is not None]
        return sum(read[1:], read[0]) if read else None


class RemoteModel:
    """A model served by an engine process, as transformers' server uses one with
    ``--continuous-batching``."""

    def __init__(self, load: dict, replicas: int = 1):
        self.name_or_path = load["model"]
        self.manager: RemoteManager | None = None
        if replicas == 1:
            self.processes = [EngineProcess(load, lambda message: self._on_message(0, message))]
        else:
            tp = load.get("tensor_parallel_size", 1)
            self.processes = start_replicas(load, replicas, tp, self._on_message)[1]
        self.config = self.processes[0].config
        self.generation_config = self.processes[0].generation_config
        self.device = torch.device("cpu")  # inputs stay on the host: the engine takes lists
        self.engine = RemoteEngine(self.processes)
        self._finalizer = weakref.finalize(self, _stop_all, list(self.processes))

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 **_ignored) -> RemoteManager:
        if self.manager is None:
            self.manager = RemoteManager(self, generation_config or self.generation_config,
                                         continuous_batching_config)
        return self.manager

    def generate(self, *args, **kwargs):
        raise NotImplementedError("hf-paged serve --engine-process serves with "
                                  "--continuous-batching only")

    def _on_message(self, index: int, message: tuple) -> None:
        if self.manager is not None:
            self.manager.on_message(index, message)

    def close(self) -> None:
        self.engine.stopped = True
        self._finalizer()


class RemoteManager(ContinuousBatchingManager):
    """transformers' continuous-batching manager, its engine in the engine process."""

    def __init__(self, model: RemoteModel, generation_config, continuous_batching_config):
        # transformers' __init__ is not called: the engine process has the model, its cache
        # and its loop. Set here is what the inherited methods and the server read.
        self.model = model
        self.processes = model.processes
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        self.output_router = OutputRouter()
        self.delivery = OutputDelivery(self.output_router)
        self.background_thread_status = BackgroundThreadStatus()
        self._request_counter = 0
        self._request_lock = threading.Lock()
        self._generation_thread: threading.Thread | None = None
        self.batch_processor = model.engine  # what /metrics reads: ``times``
        num = getattr(generation_config, "num_return_sequences", None)
        self.num_return_sequences = num if num is not None else 1
        self.is_tp_driver = True
        self.tokens: dict[str, list[int]] = {}  # request id -> its tokens so far
        self.owner: dict[str, int] = {}  # request id -> the replica it was sent to
        self.outstanding = [0] * len(self.processes)  # requests sent and not finished
        self.dead: dict[int, str] = {}  # replica -> why it serves no more

    def start(self) -> None:
        if self._generation_thread is None:
            for process in self.processes:
                process.send("init", self.generation_config, self.continuous_batching_config)
            # alive while any process's receiving thread is
            self._generation_thread = threading.Thread(
                target=lambda: [p.thread.join() for p in self.processes], daemon=True)
            self._generation_thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, **_ignored) -> None:
        self.model.close()

    def add_request(self, input_ids: list[int], request_id: str | None = None,
                    max_new_tokens: int | None = None, streaming: bool = False,
                    record_timestamps: bool = False, eos_token_id=None,
                    **logit_processor_kwargs) -> str | None:
        denial = self.background_thread_status.can_accept_new_requests()
        if denial is not None:
            raise RuntimeError(denial)
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        with self._request_lock:
            live = [i for i in range(len(self.processes)) if i not in self.dead]
            if not live:  # the status hears of it as the last one's message is handled
                raise RuntimeError("; ".join(self.dead.values()))
            replica = min(live, key=lambda i: (self.outstanding[i], i))
            self.outstanding[replica] += 1
            self.owner[request_id] = replica
        self.tokens[request_id] = []
        self.processes[replica].send("add", dict(
            input_ids=list(input_ids), request_id=request_id, max_new_tokens=max_new_tokens,
            streaming=streaming, record_timestamps=record_timestamps,
            eos_token_id=eos_token_id, **logit_processor_kwargs))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
        replica = self._done(request_id)
        if replica is not None:
            self.processes[replica].send("cancel", request_id)

    def _done(self, request_id: str) -> int | None:
        """The replica that held ``request_id`` (None: none does any more), one request less."""
        with self._request_lock:
            replica = self.owner.pop(request_id, None)
            if replica is not None:
                self.outstanding[replica] -= 1
        return replica

    def validate_request(self, input_ids: list[int], **kwargs) -> None:
        """A live engine process's ``validate_request``: a ValueError naming the problem."""
        live = [p for i, p in enumerate(self.processes) if i not in self.dead]
        problem = (live or self.processes)[0].call("validate", list(input_ids), kwargs)
        if isinstance(problem, Exception):
            raise problem
        if problem is not None:
            raise ValueError(problem)

    def on_message(self, replica: int, message: tuple) -> None:
        """On engine process ``replica``'s receiving thread: outputs to the router; a fatal
        error fails that replica's open requests with it, and goes to the status once no
        replica is left."""
        kind = message[0]
        if kind == "out":
            outputs = []
            for request_id, new, status, error in message[1]:
                tokens = self.tokens.get(request_id)
                if tokens is None:  # cancelled
                    continue
                tokens.extend(new)
                last = status in (RequestStatus.FINISHED, RequestStatus.FAILED)
                if last or not self.delivery.waiting(request_id):  # see OutputDelivery
                    outputs.append(GenerationOutput(request_id, generated_tokens=tokens,
                                                    status=status, error=error))
                if last:
                    # pop: the event loop may have cancelled it since (cancel_request)
                    self.tokens.pop(request_id, None)
                    self._done(request_id)
            if outputs:
                self.delivery.deliver(outputs)
        elif kind == "fatal":
            name = self.processes[replica].name
            why = message[1] if len(self.processes) == 1 or message[1].startswith(name) else (
                f"{name}: {message[1]}")
            with self._request_lock:
                self.dead[replica] = why
                held = [r for r, owner in self.owner.items() if owner == replica]
            failed = []
            for request_id in held:
                self._done(request_id)
                if self.tokens.pop(request_id, None) is not None:
                    failed.append(GenerationOutput(request_id, status=RequestStatus.FAILED,
                                                   error=why))
            if failed:
                self.output_router.deliver_batch(failed)
            if len(self.dead) == len(self.processes):
                self.background_thread_status.record_fatal_error(RuntimeError(why))
            else:
                logger.error("%s; the other replicas serve on", why)


def _stop_all(processes: list[EngineProcess]) -> None:
    for process in processes:
        process.stop()


def load_in_engine_process(replicas: int = 1) -> Callable[[], None]:
    """Have transformers' ``ModelManager`` load each model as a ``RemoteModel`` (the engine in
    a process of its own, or ``replicas`` of them), with the keywords its loader passes and
    the engine options of ``patch_transformers``; before any server starts (a model named on
    the command line loads when the manager is built). Returns what undoes it."""
    from transformers.cli.serving.model_manager import ModelManager

    from hf_paged.integrations.patch import engine_defaults
    from hf_paged.integrations.serve_compat import split_revision

    stock = ModelManager.__dict__["_load_model"]

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None,
                    gguf_file=None):
        if gguf_file is not None:
            raise ValueError("hf_paged serves safetensors checkpoints, not GGUF files")
        model_id, revision = split_revision(model_id_and_revision)
        return RemoteModel(dict(
            engine_defaults(), model=model_id, revision=revision, dtype=self.dtype,
            device_map=self.device, attn_implementation=self.attn_implementation), replicas)

    ModelManager._load_model = _load_model

    def restore() -> None:
        ModelManager._load_model = stock

    return restore
