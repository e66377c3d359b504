"""``hf-paged serve``'s additions around transformers' app: who may call it, how much one
request may ask, and what ``/health`` and ``/metrics`` say.

transformers' app, its handlers and its middleware stay as they are; ``install`` wraps its app
factory (``transformers.cli.serving.server.build_server``, which ``Serve`` imports when it
starts) so that every app it builds gets, in front of its own routes:

- ``Guard``, one ASGI middleware (no per-chunk work on a streamed response: it hands the
  response through untouched): with an API key, every path but ``/health`` needs
  ``Authorization: Bearer KEY`` (else a 401 in OpenAI's error shape, as vLLM's server answers);
  a request body over ``max_body_bytes`` is a 413, and a ``max_tokens`` (or
  ``max_completion_tokens`` / ``max_output_tokens``) over ``max_tokens`` a 400, each naming
  the limit, before transformers parses anything; so is a sampling value or token count of
  the wrong JSON type (transformers' ``float()`` of it would be a bare 500);
- ``serve_errors``' 400 for what the engine refuses;
- ``/health`` answering as transformers' does, plus a 503 naming why when a loaded hf_paged
  engine is broken (a tensor-parallel worker died) or the continuous-batching loop died of an
  error, and ``/metrics`` (``serve_metrics``);
- streamed responses' per-token work made cheap (``serve_stream``);
- with ``--lora NAME=PATH``, adapters selected by the requests' model names (``serve_lora``);
- a vision-language release hf_paged serves loaded as its text model, and image, video and
  audio parts of requests to hf_paged's models refused by name (``serve_vision``).
"""

from __future__ import annotations

import hmac
import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

from hf_paged.integrations import (
    serve_errors,
    serve_lora,
    serve_metrics,
    serve_stream,
    serve_vision,
)
from hf_paged.integrations.serve_options import FrontOptions

_GUARDED = "_hf_paged_front"
# The request fields that ask for new tokens, by endpoint family (chat, completions, responses).
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Sampling fields transformers' handlers convert with float(): another type is a 500 there.
_NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
_OPEN_PATHS = ("/health",)


def install(options: FrontOptions) -> Callable[[], None]:
    """Wrap transformers serve's app factory so that the apps it builds from now on get the
    guard, the 400 answers, ``/health`` and ``/metrics`` (and set the switch interval, when
    ``options`` has one); returns what undoes it."""
    from transformers.cli.serving import server

    if options.switch_interval_ms is not None:
        sys.setswitchinterval(options.switch_interval_ms / 1e3)

    stock = server.build_server
    if getattr(stock, _GUARDED, False):
        stock = stock.__wrapped__
    signature = inspect.signature(stock)

    def build_server(*args: Any, **kwargs: Any):
        app = stock(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        extend(app, bound["model_manager"], bound["generation_state"], options)
        serve_vision.refuse_media(bound)
        if options.loras:
            serve_lora.extend(bound["model_manager"], bound["generation_state"], bound,
                              dict(options.loras))
        serve_stream.fast_chunks(bound["chat_handler"], "content")
        serve_stream.fast_chunks(bound["completion_handler"], "text")
        serve_stream.replace_request_id_middleware(app)
        return app

    setattr(build_server, _GUARDED, True)
    build_server.__wrapped__ = stock  # type: ignore[attr-defined]
    server.build_server = build_server
    if options.engine_process or options.data_parallel_size > 1:
        from hf_paged.integrations.remote_manager import load_in_engine_process

        restore = load_in_engine_process(options.data_parallel_size)
    else:
        restore = lambda: None  # noqa: E731
    restore_processor = serve_vision.load_text_models()
    # after the engine process's loader: adapters go into whichever engine it loads
    restore_loader = (serve_lora.load_with_adapters(dict(options.loras)) if options.loras
                      else lambda: None)
    restore_timer = serve_stream.cheap_idle_timer()

    def uninstall() -> None:
        if server.build_server is build_server:
            server.build_server = stock
        restore_timer()
        restore_loader()
        restore_processor()
        restore()

    return uninstall


def extend(app, model_manager, generation_state, options: FrontOptions) -> None:
    """Add the guard, ``serve_errors``' answers, ``/health`` and ``/metrics`` to
    transformers' ``app``."""
    from fastapi.responses import JSONResponse

    serve_errors.extend(app, generation_state)
    app.add_middleware(Guard, options=options)  # outermost: before transformers' middleware
    served = serve_metrics.Served(model_manager, generation_state)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.get("/health")
    def health():
        reason, error = served.unhealthy()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": reason, "error": error},
                            status_code=503)

    # response_model=None: the handler's return annotation names a class imported inside a
    # function, which FastAPI's OpenAPI listing cannot resolve (/openapi.json answered 500).
    app.add_api_route("/metrics", serve_metrics.endpoint(served), methods=["GET"],
                      response_model=None)


class Guard:
    """The API key and the request limits, as a plain ASGI middleware: a request it refuses
    never reaches transformers' app; one it lets through reaches it with its body replayed."""

    def __init__(self, app, options: FrontOptions):
        self.app = app
        self.options = options
        key = options.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if (self.expected is not None and scope["path"] not in _OPEN_PATHS
                and scope["method"] != "OPTIONS"  # CORS preflights carry no credentials
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)):
            await _answer(send, 401, "invalid or missing API key: send it as "
                          "'Authorization: Bearer KEY'", code="invalid_api_key")
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        limit = self.options.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(send, limit)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = self.body_problem(body)
        if problem is not None:
            await _answer(send, 400, problem, param=problem.split(" ", 1)[0])
            return
        await self.app(scope, _replay(body, receive), send)

    def body_problem(self, body: bytes) -> str | None:
        """What is wrong with a JSON request's OpenAI fields that transformers' app would
        answer with a bare 500 (a value of the wrong type) or that asks for more tokens than
        this server allows: a sentence that starts with the field's name; None: nothing."""
        try:
            request = json.loads(body) if body else None
        except ValueError:
            return None  # transformers' app names malformed JSON (a 422)
        if not isinstance(request, dict):
            return None
        for field in _NUMBER_FIELDS:
            value = request.get(field)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                return f"{field} must be a number, got {value!r}"
        limit = self.options.max_tokens
        for field in _TOKEN_FIELDS:
            value = request.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{field} must be an integer, got {value!r}"
            if limit is not None and value > limit:
                return f"{field} {value} is over this server's limit of {limit} (--max-tokens)"
        return None


def _replay(body: bytes, receive):
    """A ``receive`` that gives the app the body read already, then the client's messages
    (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _too_large(send, limit: int) -> None:
    await _answer(send, 413, f"the request body is over this server's limit of {limit} bytes "
                  "(--max-body-bytes)")


async def _answer(send, status: int, message: str, param: str | None = None,
                  code: str | None = None) -> None:
    body = serve_errors.error_body(message)
    body["error"].update(param=param, code=code)
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
