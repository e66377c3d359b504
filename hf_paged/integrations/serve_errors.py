"""``hf-paged serve``: a request hf_paged's engine refuses gets a 400 naming the problem.

transformers serve reports any generation error the same way: a bare ``500 Internal Server
Error`` for a whole response (the message only in the server log), or an error event inside a
``200`` stream, because the engine refuses a request only once generation runs (in
``model.generate`` on the server's inference thread, or on the continuous-batching thread),
after the streaming response has started. A prompt too long for ``max_model_len`` or the KV
cache, or a sampling value the engine cannot take, is the client's mistake: OpenAI's API answers
it with a 400 whose body names it, which the ``openai`` client raises as ``BadRequestError``.

What is added, and nothing else (handlers, tokenization and generation stay transformers'):

- ``extend(app, generation_state)`` (called by ``serve_front`` on each app transformers'
  factory builds) adds two exception handlers, and has the server's ``GenerationState`` hand
  out its generation managers with a check in front of ``generate_streaming`` /
  ``generate_non_streaming``.
- The check runs when transformers' handler calls the manager: the prompt is tokenized and the
  ``GenerationConfig`` built by transformers' own code (chat template, ``max_tokens``, its
  default of 1024 new tokens, a request's ``generation_config``), and nothing has been sent
  yet. For an hf_paged model it asks the engine what generation would ask
  (``hf_paged.generation.generate.check``, or the continuous-batching manager's
  ``validate_request``); a ``ValueError`` becomes ``RefusedRequest``, answered with a 400.
- A backstop: a ``ValueError`` raised inside hf_paged that still escapes a request handler (a
  whole response: a stream has started by then) becomes a 400 with its message too. Other
  exceptions, and ``ValueError``s raised outside hf_paged, keep transformers' answer.
"""

from __future__ import annotations

import os
from typing import Any

from hf_paged.integrations import serve_stream

# What a refusal's body says, in OpenAI's error shape.
ERROR_TYPE = "invalid_request_error"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)
_GUARDED = "_hf_paged_guarded"


class RefusedRequest(Exception):
    """A request that hf_paged's engine would refuse, found before its response started."""

    status_code = 400


def error_body(message: str) -> dict[str, Any]:
    """OpenAI's error shape: the ``openai`` client reads ``error.message`` as the message."""
    return {"error": {"message": message, "type": ERROR_TYPE, "param": None, "code": None}}


def extend(app, generation_state) -> None:
    """Add the 400 answers to transformers' ``app`` and the check to ``generation_state``'s
    managers (instance attributes: other servers in the process keep theirs)."""
    from fastapi.responses import JSONResponse

    async def refused(_request, exc: RefusedRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=exc.status_code)

    async def value_error(_request, exc: ValueError) -> JSONResponse:
        if not raised_in_hf_paged(exc):
            raise exc  # transformers' own answer (Starlette's 500, the error logged)
        return JSONResponse(error_body(str(exc)), status_code=400)

    app.add_exception_handler(RefusedRequest, refused)
    app.add_exception_handler(ValueError, value_error)
    stock_get_manager = generation_state.get_manager

    def get_manager(model_id: str, use_cb: bool = False):
        manager = stock_get_manager(model_id, use_cb=use_cb)
        if not getattr(manager, _GUARDED, False):
            guard(manager)
        return manager

    generation_state.get_manager = get_manager


def guard(manager) -> None:
    """Put ``refuse_invalid`` in front of ``manager``'s two generation entry points (and keep a
    continuous-batching stream's first outputs: ``serve_stream.keep_first_outputs``; join a
    stream's pending texts: ``serve_stream.coalesce``)."""
    stream, whole = manager.generate_streaming, manager.generate_non_streaming

    def generate_streaming(model, processor, inputs, gen_config, *args: Any, **kwargs: Any):
        refuse_invalid(manager, model, processor, inputs, gen_config, streaming=True)
        cb = getattr(manager, "_cb", None)
        if cb is None:
            queue, streamer = stream(model, processor, inputs, gen_config, *args, **kwargs)
        else:
            queue, streamer = serve_stream.keep_first_outputs(  # see there: first outputs
                cb, lambda: stream(model, processor, inputs, gen_config, *args, **kwargs))
        return serve_stream.coalesce(queue), streamer  # see there: a lagging stream's text

    async def generate_non_streaming(model, processor, inputs, gen_config, *args: Any,
                                     **kwargs: Any):
        refuse_invalid(manager, model, processor, inputs, gen_config, streaming=False)
        return await whole(model, processor, inputs, gen_config, *args, **kwargs)

    manager.generate_streaming = generate_streaming
    manager.generate_non_streaming = generate_non_streaming
    setattr(manager, _GUARDED, True)


def refuse_invalid(manager, model, processor, inputs, gen_config, streaming: bool) -> None:
    """Raise ``RefusedRequest`` naming the problem when hf_paged's engine would refuse this
    generation; models that are not hf_paged's pass unchecked. The arguments are those
    transformers' handler gives the manager, which passes them on as they are."""
    from hf_paged.integrations.causal_lm import PagedCausalLM

    cb = getattr(manager, "_cb", None)  # transformers' CBGenerateManager: the CB manager
    if cb is None and not isinstance(model, PagedCausalLM):
        return
    try:
        if cb is not None:
            check = getattr(cb, "validate_request", None)
            if check is not None:  # hf_paged's managers; transformers' own has none
                # what transformers' CBGenerateManager passes to add_request
                check(inputs["input_ids"], max_new_tokens=gen_config.max_new_tokens,
                      eos_token_id=gen_config.eos_token_id)
            return
        from transformers.generation.streamers import BaseStreamer

        from hf_paged.generation.generate import check

        # what transformers' GenerateManager passes to model.generate (its streamer aside)
        check(model.engine, **inputs, generation_config=gen_config, tokenizer=processor,
              streamer=BaseStreamer() if streaming else None)
    except ValueError as error:
        raise RefusedRequest(str(error)) from error


def raised_in_hf_paged(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while hf_paged's code ran (a frame of its traceback is in
    the package, this module's wrappers aside)."""
    tb = exc.__traceback__
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if filename.startswith(_PACKAGE_DIR + os.sep) and filename != _THIS_FILE:
            return True
        tb = tb.tb_next
    return False
