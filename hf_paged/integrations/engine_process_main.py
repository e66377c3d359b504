"""The engine process's side of ``engine_process``: the model, its continuous-batching manager,
the forwarding of its outputs, a data-parallel replica's ``generate`` calls; ``child`` is the
process's entry point."""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from hf_paged.device_copy import moved

logger = logging.getLogger(__name__)

class _Handoff:
    """What the engine's output router takes for an event loop: ``call_soon_threadsafe``
    queues the call for the forwarding thread (no event loop in this process)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()

    def call_soon_threadsafe(self, function, *args) -> None:
        self.calls.put((function, args))


def _failed():
    from transformers.generation.continuous_batching.requests import RequestStatus

    return RequestStatus.FAILED


class _Engine:
    """The engine process's side: the model, its manager, and the forwarding of outputs."""

    def __init__(self, conn: Connection, model):
        self.conn = conn
        self.model = model
        self.manager = None
        self.handoff = _Handoff()
        self.sent: dict[str, int] = {}  # request id -> tokens sent
        self.collected: list = []  # outputs the router handed over, for the forwarding thread
        self.lock = threading.Lock()
        self.generates: queue.SimpleQueue | None = None  # started by the first generate call

    def send(self, *message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "stop":
                break
            try:
                getattr(self, f"on_{kind}")(*message[1:])
            except Exception as error:  # one message's failure is reported, the loop goes on
                logger.exception("engine process: %s failed", kind)
                if kind == "call":
                    self.send("reply", message[1], error)
                elif kind == "add":  # the request fails alone, named, instead of never ending
                    self.send("out", [(message[1]["request_id"], [], _failed(), repr(error))])
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30)

    def on_init(self, generation_config, cb_config) -> None:
        self.manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config)
        self.manager.start()
        threading.Thread(target=self.forward, daemon=True).start()
        threading.Thread(target=self.watch, daemon=True).start()

    def on_add(self, kwargs: dict) -> None:
        router = self.manager.output_router
        request_id = kwargs["request_id"]
        with router._lock:
            router.result_handlers[request_id] = (self.collected.append, self.handoff)
        self.manager.add_request(**kwargs)

    def on_cancel(self, request_id: str) -> None:
        self.manager.cancel_request(request_id)
        self._forget(request_id)

    def on_call(self, call_id: int, name: str, args: tuple) -> None:
        if name == "generate":
            if self.generates is None:
                self.generates = queue.SimpleQueue()
                threading.Thread(target=self.generate, daemon=True).start()
            self.generates.put((call_id, args[0]))
            return
        if name == "validate":
            try:
                self.manager.validate_request(*args[:1], **args[1])
                value = None
            except ValueError as error:
                value = str(error)
        elif name == "load_loras":  # {name: folder}; a bad one: the message naming it
            from hf_paged.lora.named import AdapterSpecError, load_loras

            try:
                load_loras(self.model.engine, *args)
                value = None
            except AdapterSpecError as error:
                value = str(error)
        elif name == "stats":
            engine = self.model.engine
            loop = getattr(self.manager, "batch_processor", None)
            value = (engine.stats(), getattr(loop, "times", None), engine.broken)
        else:
            raise ValueError(f"no call {name!r}")
        self.send("reply", call_id, value)

    def generate(self) -> None:
        """``model.generate``, ``model.engine.generate_tokens`` or the model call's
        ``forward`` / ``hidden_states`` for each call in turn:
        pickled (name, arguments, the front's generation config) in, the pickled result (on
        the host) or the exception back."""
        while True:
            call_id, blob = self.generates.get()
            try:
                name, args, kwargs, self.model.generation_config = pickle.loads(blob)
                target = {"generate": self.model.generate,
                          "generate_tokens": self.model.engine.generate_tokens,
                          "forward": self.model.engine.forward,
                          "hidden_states": self.model.engine.hidden_states}[name]
                value = pickle.dumps(moved(target(*args, **kwargs), "cpu"))
            except Exception as error:
                value = error
            try:
                self.send("reply", call_id, value)
            except Exception as error:  # an exception that does not pickle: named by its repr
                self.send("reply", call_id, RuntimeError(repr(error)))

    def forward(self) -> None:
        """Each batch of outputs as one message: the tokens not sent yet, status, error."""
        calls = self.handoff.calls
        while True:
            function, args = calls.get()
            function(*args)
            while True:
                try:
                    function, args = calls.get_nowait()
                except queue.Empty:
                    break
                function(*args)
            batch, self.collected[:] = list(self.collected), []
            updates = []
            for output in batch:
                tokens = output.generated_tokens
                end, start = len(tokens), self.sent.get(output.request_id, 0)
                updates.append((output.request_id, tokens[start:end], output.status,
                                output.error))
                if output.is_finished():
                    self._forget(output.request_id)
                else:
                    self.sent[output.request_id] = end
            self.send("out", updates)

    def watch(self) -> None:
        """Tell the server when the loop stopped on an error (its requests failed already)."""
        self.manager._generation_thread.join()
        error = self.manager.background_thread_status.fatal_error
        if error is not None:
            self.send("fatal", str(error))

    def _forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        with self.manager.output_router._lock:
            self.manager.output_router.result_handlers.pop(request_id, None)


def child() -> None:
    """The engine process's entry point: load, report, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    _, load = conn.recv()
    try:
        from hf_paged.integrations.causal_lm import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(load.pop("model"), **load)
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", model.config, model.generation_config))
    _Engine(conn, model).serve()
    model.close()
