"""``hf-paged serve --engine-process``: the engine and its continuous-batching loop in a process
of their own, transformers' app (HTTP, tokenisation, detokenisation, SSE) in the server's.

The two share no GIL: the engine's step loop runs at the device's pace whatever the server does
per streamed token (vLLM's split of API server and engine core). They talk over a socket pair
(``multiprocessing.connection``, pickled tuples):

- server -> engine: ``("init", generation_config, continuous_batching_config)`` (the manager
  starts), ``("add", kwargs)`` (``add_request``'s), ``("cancel", request_id)``,
  ``("call", call_id, name, args)`` (``validate`` a request, read ``stats``, ``load_loras``
  from their folders before the manager starts), ``("stop",)``;
- engine -> server: ``("ready", config, generation_config)`` once loaded (or ``("failed",
  message)``), ``("out", updates)`` once per batch of outputs, each update ``(request_id, new
  tokens, status, error)``, ``("reply", call_id, value)``, ``("fatal", message)`` when the
  loop stopped on an error (a tensor-parallel worker died).

The engine process ignores SIGINT and SIGTERM (the server finishes its open streams first) and
exits when the server tells it to or its end of the socket closes (the server died).
"""

from __future__ import annotations

import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)
_CHILD = "from hf_paged.integrations.engine_process import child; child()"


class EngineProcess:
    """The server's handle on an engine process: start, send, call, and a thread that hands
    each message it sends to ``on_message``."""

    def __init__(self, load: dict[str, Any], on_message):
        parent, child_end = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno())],
                                        pass_fds=[child_end.fileno()])
        child_end.close()
        self.conn = Connection(parent.detach())
        self._send_lock = threading.Lock()
        self._calls: dict[int, queue.SimpleQueue] = {}
        self._next_call = 0
        self.conn.send(("load", load))
        try:
            reply = self.conn.recv()
        except EOFError:
            reply = ("failed", f"it exited (code {self.process.wait()})")
        if reply[0] != "ready":
            self.process.wait(timeout=30)
            raise RuntimeError(f"the engine process could not load the model: {reply[1]}")
        self.config, self.generation_config = reply[1], reply[2]
        self.on_message = on_message
        self.thread = threading.Thread(target=self._receive, name="hf_paged-engine-process",
                                       daemon=True)
        self.thread.start()

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        """``name(*args)`` in the engine process (``validate``, ``stats``); its value."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        with self._send_lock:
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = reply
            self.conn.send(("call", call_id, name, args))
        try:
            value = reply.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the engine process did not answer {name} in {timeout:.0f} s "
                               f"(exit code {self.process.poll()})") from None
        finally:
            self._calls.pop(call_id, None)
        if isinstance(value, BaseException):  # the call raised there
            raise RuntimeError(f"the engine process's {name} failed: {value!r}") from value
        return value

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                code = self.process.wait()
                self.on_message(("fatal", f"the engine process exited (code {code})"))
                return
            if message[0] == "reply":
                waiting = self._calls.get(message[1])
                if waiting is not None:
                    waiting.put(message[2])
            else:
                try:
                    self.on_message(message)
                except Exception as error:  # a stream that hears nothing more would hang
                    logger.exception("handling the engine process's output failed")
                    self.on_message(("fatal", f"handling the engine's output failed: {error!r}"))
                    return

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.send("stop")
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


# ---- the engine process ------------------------------------------------------------------------

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
        import hf_paged

        model = hf_paged.AutoModelForCausalLM.from_pretrained(load.pop("model"), **load)
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", model.config, model.generation_config))
    _Engine(conn, model).serve()
    model.close()
