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
"""

from __future__ import annotations

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

from hf_paged.integrations.engine_process import EngineProcess
from hf_paged.integrations.output_delivery import OutputDelivery


class RemoteEngine:
    """What ``/health`` and ``/metrics`` read of an engine (``serve_metrics``), asked of the
    engine process."""

    def __init__(self, process: EngineProcess):
        self.process = process
        self.stopped = False

    @property
    def closed(self) -> bool:
        """Stopped, or its process exited (``/health`` then reports the loop's fatal error)."""
        return self.stopped or self.process.process.poll() is not None

    def _read(self):
        return self.process.call("stats")

    def stats(self) -> dict[str, int]:
        return self._read()[0]

    def load_loras(self, loras: dict[str, str]) -> None:
        """Load LoRA adapters from their folders in the engine process (``named.load_loras``);
        an ``AdapterSpecError`` naming a bad one."""
        from hf_paged.lora.named import AdapterSpecError

        problem = self.process.call("load_loras", loras, timeout=600.0)
        if problem is not None:
            raise AdapterSpecError(problem)

    @property
    def broken(self) -> str | None:
        return self._read()[2]

    @property
    def times(self):
        return self._read()[1]


class RemoteModel:
    """A model served by an engine process, as transformers' server uses one with
    ``--continuous-batching``."""

    def __init__(self, load: dict):
        self.name_or_path = load["model"]
        self.manager: RemoteManager | None = None
        self.process = EngineProcess(load, self._on_message)
        self.config = self.process.config
        self.generation_config = self.process.generation_config
        self.device = torch.device("cpu")  # inputs stay on the host: the engine takes lists
        self.engine = RemoteEngine(self.process)
        self._finalizer = weakref.finalize(self, self.process.stop)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 **_ignored) -> RemoteManager:
        if self.manager is None:
            self.manager = RemoteManager(self, generation_config or self.generation_config,
                                         continuous_batching_config)
        return self.manager

    def generate(self, *args, **kwargs):
        raise NotImplementedError("hf-paged serve --engine-process serves with "
                                  "--continuous-batching only")

    def _on_message(self, message: tuple) -> None:
        if self.manager is not None:
            self.manager.on_message(message)

    def close(self) -> None:
        self.engine.stopped = True
        self._finalizer()


class RemoteManager(ContinuousBatchingManager):
    """transformers' continuous-batching manager, its engine in the engine process."""

    def __init__(self, model: RemoteModel, generation_config, continuous_batching_config):
        # transformers' __init__ is not called: the engine process has the model, its cache
        # and its loop. Set here is what the inherited methods and the server read.
        self.model = model
        self.process = model.process
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

    def start(self) -> None:
        if self._generation_thread is None:
            self.process.send("init", self.generation_config, self.continuous_batching_config)
            self._generation_thread = self.process.thread

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
        self.tokens[request_id] = []
        self.process.send("add", dict(
            input_ids=list(input_ids), request_id=request_id, max_new_tokens=max_new_tokens,
            streaming=streaming, record_timestamps=record_timestamps,
            eos_token_id=eos_token_id, **logit_processor_kwargs))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
        self.process.send("cancel", request_id)

    def validate_request(self, input_ids: list[int], **kwargs) -> None:
        """The engine process's ``validate_request``: a ValueError naming the problem."""
        problem = self.process.call("validate", list(input_ids), kwargs)
        if isinstance(problem, Exception):
            raise problem
        if problem is not None:
            raise ValueError(problem)

    def on_message(self, message: tuple) -> None:
        """On the engine process's receiving thread: outputs to the router, a fatal error to
        the status (and every open request fails with it)."""
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
            if outputs:
                self.delivery.deliver(outputs)
        elif kind == "fatal":
            error = RuntimeError(message[1])
            failed = [GenerationOutput(request_id, status=RequestStatus.FAILED, error=str(error))
                      for request_id in list(self.tokens)]
            self.tokens.clear()
            if failed:
                self.output_router.deliver_batch(failed)
            self.background_thread_status.record_fatal_error(error)


def load_in_engine_process() -> Callable[[], None]:
    """Have transformers' ``ModelManager`` load each model as a ``RemoteModel`` (the engine in
    a process of its own), with the keywords its loader passes and the engine options of
    ``patch_transformers``; before any server starts (a model named on the command line loads
    when the manager is built). Returns what undoes it."""
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
            device_map=self.device, attn_implementation=self.attn_implementation))

    ModelManager._load_model = _load_model

    def restore() -> None:
        ModelManager._load_model = stock

    return restore
