"""Helpers for the ``transformers serve`` tests: an offline hub cache holding the tiny
checkpoint, server processes on 127.0.0.1 bounded in time, transformers' server run inside the
test process, and one request through the official openai client as a comparable outcome."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import torch
import transformers

import hf_paged

HOST = "127.0.0.1"
# The checkpoint's id in the hub cache made by ``hub_cache``: /v1/models lists what that cache
# holds, and both servers load it by id (offline), as a user's server loads a hub model.
MODEL = "hf-paged-tests/tiny-qwen3"
START_TIMEOUT = 90.0  # seconds for a server to import, load the model and answer /health
REQUEST_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def hub_cache(root: Path, checkpoint: str) -> str:
    """A Hugging Face hub cache in ``root`` holding ``checkpoint`` as ``MODEL`` at ``main``
    (its snapshot files link to the checkpoint's)."""
    repo = root / f"models--{MODEL.replace('/', '--')}"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in os.listdir(checkpoint):
        (snapshot / name).symlink_to(Path(checkpoint, name).resolve())
    return str(root)


def server_env(cache: str) -> dict[str, str]:
    """Offline, the hub cache above, no update check; one CPU thread per server (three run at
    once on a small machine, and torch's thread pool on a tiny model only contends)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache,
                HF_HUB_DISABLE_UPDATE_CHECK="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


def wait_healthy(url: str, alive: Callable[[], bool], why_not: Callable[[], str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not alive():
            raise AssertionError(f"server at {url} exited:\n{why_not()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"server at {url} not healthy after {START_TIMEOUT:.0f} s:\n{why_not()}")


class ServerProcess:
    """A server command started now, on a free port, its output kept in ``log``;
    ``url()`` waits until it answers."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen([*argv, "--host", HOST, "--port", str(self.port)],
                                            env=env, stdout=out, stderr=subprocess.STDOUT)
        self._ready = False

    def url(self) -> str:
        url = f"http://{HOST}:{self.port}"
        if not self._ready:
            wait_healthy(url, lambda: self.process.poll() is None, self.log_tail)
            self._ready = True
        return url

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@contextmanager
def in_process_server(checkpoint: str, continuous_batching: bool, front=None,
                      **engine_options) -> Iterator[tuple[str, object]]:
    """transformers' own server (``transformers.cli.serve.Serve``, with uvicorn in a thread, as
    transformers' own tests run it) in this process, patched and extended as hf-paged serve
    does (``front``: its ``FrontOptions``, None: the defaults): yields its URL and the model it
    loaded (hf_paged's, or with ``--engine-process`` its handle on the engine process), so that
    a test can read the engine's state afterwards."""
    from transformers.cli.serve import Serve

    from hf_paged.integrations import serve_front
    from hf_paged.integrations.causal_lm import PagedCausalLM
    from hf_paged.integrations.remote_manager import RemoteModel
    from hf_paged.integrations.serve_options import FrontOptions

    port, threads = free_port(), torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()  # Serve sets transformers' log level
    torch.set_num_threads(1)
    uninstall = serve_front.install(front or FrontOptions())  # as hf-paged serve
    try:
        with hf_paged.patch_transformers(**engine_options):
            server = Serve(force_model=checkpoint, device="cpu", dtype="float32",
                           continuous_batching=continuous_batching, host=HOST, port=port,
                           log_level="error", non_blocking=True)
        try:
            url = f"http://{HOST}:{port}"
            wait_healthy(url, server._thread.is_alive, lambda: "(in-process server)")
            (timed_model,) = server._model_manager.loaded_models.values()
            assert isinstance(timed_model.model, (PagedCausalLM, RemoteModel))
            yield url, timed_model.model
        finally:
            server.kill_server()
    finally:
        uninstall()
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         timeout=REQUEST_TIMEOUT)


def ask(url: str, endpoint: str, stream: bool = False, **request) -> dict:
    """One request to ``/v1/chat/completions`` (``endpoint="chat"``) or ``/v1/completions``,
    through a fresh client (transformers' server drops the connection after a 500, so a pooled
    one would fail the next request), as a comparable outcome: the choices' text and finish
    reasons and the usage; or the HTTP status and error body; or the error a stream carried."""
    with client(url) as c:
        create = c.chat.completions.create if endpoint == "chat" else c.completions.create
        try:
            response = create(model=request.pop("model", MODEL), stream=stream, **request)
            return streamed(response) if stream else whole(response)
        except openai.APIStatusError as error:
            return {"status": error.status_code, "error": error.body}
        except openai.APIConnectionError:
            raise
        except openai.APIError as error:  # an error event inside a 200 stream
            return {"stream_error": error.body}


def whole(response) -> dict:
    return {"choices": [(*_text(choice), choice.finish_reason) for choice in response.choices],
            "usage": (response.usage.prompt_tokens, response.usage.completion_tokens)}


def streamed(chunks) -> dict:
    """A stream's chunks joined per choice: its text (content and reasoning), last finish
    reason, and the usage the last chunk carries."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        for choice in chunk.choices:
            content, reasoning = _text(choice)
            parts = texts.setdefault(choice.index, ["", ""])
            parts[0] += content or ""
            parts[1] += reasoning or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return {"choices": [(c, r or None, finish.get(i)) for i, (c, r) in sorted(texts.items())],
            "usage": usage}


def _text(choice) -> tuple[str | None, str | None]:
    """(content, reasoning_content) of a chat choice or delta; (text, None) for completions."""
    message = getattr(choice, "message", None) or getattr(choice, "delta", None)
    if message is None:
        return choice.text, None
    return message.content, (message.model_extra or {}).get("reasoning_content")
