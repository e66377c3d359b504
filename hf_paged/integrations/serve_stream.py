"""The per-token work of transformers serve's streamed responses, made cheap where it is the
same every token, and its per-request work where it needs none.

Measured per streamed token on transformers' event loop (``benchmarks/profile_serving.py``,
the tiny checkpoint, 64 streams): detokenisation (``CBStreamer.put``) is a few microseconds;
most of the time goes to building each SSE chunk (``_build_chunk_sse``: an ``openai`` model
built field by field with ``construct``, then ``model_dump_json``) and to transformers'
``request_id_middleware``, a ``BaseHTTPMiddleware`` that passes every chunk of a response
through an extra memory stream and task. That time is spent holding the GIL, which the
engine's step loop needs too.

- ``fast_chunks(handler, text_field)``: a handler's ``_build_chunk_sse`` builds a stream's
  text chunk once with transformers' own code, around a marker, and every later chunk of the
  stream that differs only by its text as that template with the text's JSON in place of the
  marker (same fields, same order; the chunk's ``created`` second is the stream's first, as
  OpenAI's own chunks carry). Other chunks (the role, reasoning, tool calls, the last one with
  its finish reason and usage) are transformers' own.
- ``RequestId``: transformers' request-id middleware as a plain ASGI middleware: the same
  ``X-Request-ID`` header in and out, and ``request.state.request_id``, with no per-chunk
  work.
- ``coalesce(queue)``: a stream's text queue (transformers' handlers read it, build a chunk an
  item) joins a text put while the previous one still waits unread to that one, so that a
  stream whose reader lags (a busy event loop, a client that reads slowly) sends its pending
  tokens as one chunk (OpenAI's format allows a delta of several tokens; vLLM's stream
  interval does the same) instead of one chunk a token, and the work a chunk costs (building
  it, writing it, the client parsing it) is paid once for all of them. A reader that keeps up
  gets one item a put, as before. The text, concatenated, is the same.
- ``cheap_idle_timer``: transformers' ``TimedModel.reset_timer`` (every request, on the event
  loop) starts a new ``threading.Timer`` thread and waits for it to start, for the GIL too: up
  to a switch interval a request while the engine's thread holds it. Replaced: a model that
  never unloads (a model named on the command line) has no timer; another keeps one timer
  thread that, when it fires, waits out the rest of the timeout from the last request.
- ``keep_first_outputs``: transformers' continuous-batching streams register their result
  handler after ``add_request`` returns; an output the engine delivers in between would go to
  the manager's queue, which nobody reads, and the stream would never end. A placeholder
  handler, registered before the request is added, passes such outputs on to the stream's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# A text no model emits, replaced in a chunk's JSON by the token's text.
_MARKER = "\x00hf_paged_text\x00"
_MARKER_JSON = json.dumps(_MARKER)[1:-1]
_MAX_STREAMS = 65536  # templates kept (one a stream, dropped when its last chunk is built)
_IDENTITY = {"model", "model_id", "request_id"}  # what names a stream in a chunk call


def fast_chunks(handler, text_field: str) -> None:
    """Replace ``handler._build_chunk_sse`` (an instance attribute: other handlers keep
    theirs) by a templated twin for chunks that carry only ``text_field``'s text, as
    transformers' handlers call it: positional identity (request id, model id), the model
    perhaps by keyword, the text by keyword."""
    stock = handler._build_chunk_sse
    templates: OrderedDict[tuple, tuple[str, str]] = OrderedDict()

    def build_chunk_sse(*args: Any, **kwargs: Any) -> str:
        text = kwargs.pop(text_field, None)
        key = (*args, *kwargs.items())
        if (type(text) is not str or not kwargs.keys() <= _IDENTITY
                or not all(type(a) is str for a in args)):
            if "finish_reason" in kwargs:  # the stream's last chunk: its template goes
                templates.pop((*args, *((k, v) for k, v in kwargs.items()
                                        if k in _IDENTITY)), None)
            if text is not None:
                kwargs[text_field] = text
            return stock(*args, **kwargs)
        template = templates.get(key)
        if template is None:
            built = stock(*args, **kwargs, **{text_field: _MARKER})
            if built.count(_MARKER_JSON) != 1:
                return stock(*args, **kwargs, **{text_field: text})
            template = templates[key] = tuple(built.split(_MARKER_JSON))
            if len(templates) > _MAX_STREAMS:
                templates.popitem(last=False)
        head, tail = template
        return head + json.dumps(text, ensure_ascii=False)[1:-1] + tail

    handler._build_chunk_sse = build_chunk_sse


def coalesce(queue: asyncio.Queue) -> asyncio.Queue:
    """Have ``queue`` join a text (a ``str``, or a subclass such as transformers'
    ``ReasoningText``) put while the item before it, of the same type, waits unread, to that
    item; every other item is queued as it is. Returns ``queue``."""
    pending = queue._queue  # asyncio.Queue's deque of unread items
    stock = queue.put_nowait

    def put_nowait(item: Any) -> None:
        kind = type(item)
        if pending and isinstance(item, str) and type(pending[-1]) is kind:
            pending[-1] = kind(pending[-1] + item)  # the reader was woken by the first one
        else:
            stock(item)

    queue.put_nowait = put_nowait
    return queue


def cheap_idle_timer() -> Callable[[], None]:
    """Replace transformers' ``TimedModel.reset_timer`` (a thread started a request) by one
    that starts none (see the module's doc); returns what undoes it."""
    from transformers.cli.serving.model_manager import TimedModel

    stock = TimedModel.reset_timer
    lock = threading.Lock()

    def reset_timer(self) -> None:
        self._hf_paged_last_use = time.monotonic()
        if self.timeout_seconds <= 0 or _rearming(self._timer):
            return  # no timer needed / the running one re-arms itself when it fires
        with lock:
            if not _rearming(self._timer):  # transformers' first timer, or none running
                self._timer.cancel()
                self._timer = _rearming_timer(self, self.timeout_seconds)
                self._timer.start()

    TimedModel.reset_timer = reset_timer

    def restore() -> None:
        TimedModel.reset_timer = stock

    return restore


def _rearming_timer(model, seconds: float) -> threading.Timer:
    """A timer that unloads ``model`` once ``timeout_seconds`` have passed since its last
    request, and otherwise waits for the rest of them."""

    def fire() -> None:
        idle = time.monotonic() - getattr(model, "_hf_paged_last_use", 0.0)
        if idle >= model.timeout_seconds:
            model._timeout_reached()
        else:
            model._timer = _rearming_timer(model, model.timeout_seconds - idle)
            model._timer.start()

    timer = threading.Timer(seconds, fire)
    timer.rearms = True
    return timer


def _rearming(timer: threading.Timer) -> bool:
    return getattr(timer, "rearms", False) and timer.is_alive()


def keep_first_outputs(cb, start_stream):
    """``start_stream()`` (transformers' ``CBGenerateManager.generate_streaming``: ``cb``'s
    ``add_request``, then ``register_result_handler``) with a placeholder handler registered
    for the request before it is added. Runs on the event loop, synchronously: the
    placeholder's calls run after it returns, when the stream's handler has replaced it, and
    go to that handler, before any output delivered to it directly."""
    router, loop = cb.output_router, asyncio.get_running_loop()
    own = cb.__dict__.get("add_request")
    add = cb.add_request

    def add_request(*args, **kwargs):
        request_id = kwargs.get("request_id")
        if request_id is None:
            return add(*args, **kwargs)

        def placeholder(output) -> None:
            entry = router.result_handlers.get(request_id)
            if entry is not None and entry[0] is not placeholder:
                entry[0](output)  # the stream's handler (none: the request was dropped)

        with router._lock:
            router.result_handlers.setdefault(request_id, (placeholder, loop))
        added = None
        try:
            added = add(*args, **kwargs)
            return added
        finally:
            if added is None:  # not taken: nothing will come
                with router._lock:
                    if router.result_handlers.get(request_id, (None,))[0] is placeholder:
                        del router.result_handlers[request_id]

    cb.add_request = add_request
    try:
        return start_stream()
    finally:
        if own is None:
            del cb.add_request
        else:
            cb.add_request = own


class RequestId:
    """transformers serve's ``request_id_middleware`` (the client's ``X-Request-ID`` or a new
    uuid4, in ``request.state.request_id`` and on the response) as a plain ASGI middleware."""

    def __init__(self, app, header: str):
        self.app = app
        self.header = header.lower().encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((v for k, v in scope["headers"] if k == self.header), None)
        request_id = request_id.decode("latin-1") if request_id else str(uuid.uuid4())
        scope.setdefault("state", {})["request_id"] = request_id
        value = request_id.encode("latin-1")

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != self.header]
                message = dict(message, headers=[*headers, (self.header, value)])
            await send(message)

        await self.app(scope, receive, send_with_id)


def replace_request_id_middleware(app) -> bool:
    """Swap transformers' ``request_id_middleware`` in ``app`` (not started yet) for
    ``RequestId``; False when the app has none (another transformers version)."""
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from transformers.cli.serving.utils import X_REQUEST_ID

    for i, middleware in enumerate(app.user_middleware):
        dispatch = middleware.kwargs.get("dispatch")
        if (middleware.cls is BaseHTTPMiddleware
                and getattr(dispatch, "__name__", "") == "request_id_middleware"):
            app.user_middleware[i] = Middleware(RequestId, header=X_REQUEST_ID)
            return True
    return False
