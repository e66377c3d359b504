"""``hf-paged serve --engine-process``: the engine and its continuous-batching loop in a process
of their own, transformers' app (HTTP, tokenisation, detokenisation, SSE) in the server's.

The two share no GIL: the engine's step loop runs at the device's pace whatever the server does
per streamed token (vLLM's split of API server and engine core). They talk over a socket pair
(``multiprocessing.connection``, pickled tuples):

- server -> engine: ``("init", generation_config, continuous_batching_config)`` (the manager
  starts), ``("add", kwargs)`` (``add_request``'s), ``("cancel", request_id)``,
  ``("call", call_id, name, args)`` (``validate`` a request, read ``stats``, ``load_loras``
  from their folders before the manager starts; ``generate``, a data-parallel replica's
  ``generate`` or ``generate_tokens``: the name, arguments, the front's generation config
  and the result pickled, on the host, run one call at a time on a thread of their own so
  that ``stats`` answers meanwhile), ``("stop",)``;
- engine -> server: ``("ready", config, generation_config)`` once loaded (or ``("failed",
  message)``), ``("out", updates)`` once per batch of outputs, each update ``(request_id, new
  tokens, status, error)``, ``("reply", call_id, value)``, ``("fatal", message)`` when the
  loop stopped on an error (a tensor-parallel worker died).

The engine process's side is ``engine_process_main``. It ignores SIGINT and SIGTERM (the
server finishes its open streams first) and exits when the server tells it to or its end of
the socket closes (the server died).
"""

from __future__ import annotations

import logging
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)
_CHILD = "from hf_paged.integrations.engine_process_main import child; child()"


class ProcessDied(RuntimeError):
    """The engine process exited while a call waited on it (or before the call was made)."""


class EngineProcess:
    """The server's handle on an engine process: start, send, call, and a thread that hands
    each message it sends to ``on_message``. ``label`` names it in errors (with its pid);
    ``env``: the process's environment (a data-parallel replica's visible GPUs)."""

    def __init__(self, load: dict[str, Any], on_message, label: str | None = None,
                 env: dict[str, str] | None = None):
        parent, child_end = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno())],
                                        pass_fds=[child_end.fileno()], env=env)
        child_end.close()
        self.name = f"{label} (pid {self.process.pid})" if label else "the engine process"
        self.died: str | None = None
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
            raise RuntimeError(f"{self.name} could not load the model: {reply[1]}")
        self.config, self.generation_config = reply[1], reply[2]
        self.on_message = on_message
        self.thread = threading.Thread(target=self._receive, name="hf_paged-engine-process",
                                       daemon=True)
        self.thread.start()

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def call(self, name: str, *args: Any, timeout: float | None = 60.0,
             raw: bool = False) -> Any:
        """``name(*args)`` in the engine process (``validate``, ``stats``, ``generate``); its
        value. An exception raised there: wrapped in a RuntimeError naming the call, or itself
        with ``raw``; the process's exit: ``ProcessDied`` naming it."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        with self._send_lock:
            if self.died is not None:
                raise ProcessDied(self.died)
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = reply
            self.conn.send(("call", call_id, name, args))
        try:
            value = reply.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name} did not answer {name} in {timeout:.0f} s "
                               f"(exit code {self.process.poll()})") from None
        finally:
            self._calls.pop(call_id, None)
        if isinstance(value, ProcessDied) or raw and isinstance(value, BaseException):
            raise value
        if isinstance(value, BaseException):  # the call raised there
            raise RuntimeError(f"{self.name}'s {name} failed: {value!r}") from value
        return value

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                code = self.process.wait()
                with self._send_lock:  # no call is made after this without hearing of it
                    self.died = f"{self.name} exited (code {code})"
                    for waiting in self._calls.values():
                        waiting.put(ProcessDied(self.died))
                self.on_message(("fatal", self.died))
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
