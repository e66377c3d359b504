"""hf-paged serve's additions around transformers' app: the API key, the request limits,
``/health`` and ``/metrics``, on transformers' server run in this process with continuous
batching (the tiny checkpoint, float32 on CPU), driven by the openai client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hf_paged.cli import main
from hf_paged.integrations.serve_options import API_KEY_ENV, FrontOptions, take_front_options
from tests.clients.serve_helpers import REQUEST_TIMEOUT, in_process_server
from tests.conftest import SMALL

KEY = "sk-test-key"
LIMITS = FrontOptions(api_key=KEY, max_body_bytes=4000, max_tokens=16)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with in_process_server(tiny_checkpoint, True, front=LIMITS, **SMALL) as (url, model):
        yield url, model, tiny_checkpoint


def get(url: str, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                         timeout=REQUEST_TIMEOUT)


def test_api_key_on_every_endpoint_but_health(server):
    url, _, model = server
    assert get(f"{url}/health") == (200, '{"status":"ok"}')
    preflight = urllib.request.Request(f"{url}/v1/models", method="OPTIONS")
    with urllib.request.urlopen(preflight, timeout=REQUEST_TIMEOUT) as response:
        assert response.status == 200  # transformers' own answer, no key asked
    for path in ("/v1/models", "/metrics"):
        assert get(f"{url}{path}")[0] == 401
        assert get(f"{url}{path}", "wrong")[0] == 401
        assert get(f"{url}{path}", KEY)[0] == 200
    with openai_client(url, "wrong") as c, pytest.raises(openai.AuthenticationError,
                                                          match="API key") as caught:
        c.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert caught.value.body["code"] == "invalid_api_key"
    with openai_client(url, KEY) as c:
        assert c.completions.create(model=model, prompt="Hi", max_tokens=2).usage.total_tokens


def test_limits_named(server):
    url, _, model = server
    with openai_client(url, KEY) as c:
        with pytest.raises(openai.BadRequestError, match="max_tokens 17 is over this server's "
                           "limit of 16"):
            c.completions.create(model=model, prompt="Hi", max_tokens=17)
        with pytest.raises(openai.BadRequestError, match="max_completion_tokens 99"):
            c.chat.completions.create(model=model, max_completion_tokens=99,
                                      messages=[{"role": "user", "content": "Hi"}])
        with pytest.raises(openai.APIStatusError, match="over this server's limit of 4000 "
                           "bytes") as caught:
            c.completions.create(model=model, prompt="river " * 1000, max_tokens=2)
        assert caught.value.status_code == 413
        assert c.completions.create(model=model, prompt="Hi", max_tokens=16).usage


def test_metrics(server):
    url, engine_model, model = server
    with openai_client(url, KEY) as c:
        for max_tokens in (3, 5):
            c.completions.create(model=model, prompt="The river", max_tokens=max_tokens)
    status, text = get(f"{url}/metrics", KEY)
    assert status == 200
    samples = {(s.name, s.labels.get("le")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    stats = engine_model.engine.stats()
    assert samples["hf_paged_kv_blocks_total", None] == stats["num_blocks"]
    assert samples["hf_paged_kv_blocks_used", None] == 0  # nothing runs
    assert samples["hf_paged_requests_running", None] == samples[
        "hf_paged_requests_waiting", None] == 0
    assert samples["hf_paged_engine_healthy", None] == 1
    assert samples["hf_paged_generation_tokens_total", None] >= 8
    finished = samples["hf_paged_requests_finished_total", None]
    assert finished >= 2
    assert samples["hf_paged_time_to_first_token_seconds_count", None] == finished
    assert samples["hf_paged_time_to_first_token_seconds_bucket", "+Inf"] == finished
    assert 0 < samples["hf_paged_time_per_output_token_seconds_count", None] <= finished
    for name in ("prefix_cache_hit_rate", "prefix_cache_queries_total", "preemptions_total",
                 "generation_tokens_per_second"):
        assert f"hf_paged_{name}" in {n for n, _ in samples}, name


def test_front_options(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    options, rest = take_front_options(["m", "--api-key", "k", "--max-tokens=8", "--port", "1",
                                        "--switch-interval-ms", "0.5"])
    assert options == FrontOptions(api_key="k", max_tokens=8, switch_interval_ms=0.5)
    assert rest == ["m", "--port", "1"]
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert take_front_options([])[0].api_key == "from-env"
    assert take_front_options(["--api-key", "flag"])[0].api_key == "flag"


@pytest.mark.parametrize("argv, match", [
    (["serve", "--max-tokens", "0"], "--max-tokens must be a positive integer, got 0"),
    (["serve", "--max-body-bytes=lots"], "--max-body-bytes must be a positive integer"),
    (["serve", "--api-key"], "--api-key needs a value"),
    (["serve", "--api-key="], "--api-key must not be empty"),
    (["serve", "--switch-interval-ms", "0"], "--switch-interval-ms must be in (0, 1000]"),
    (["serve", "--switch-interval-ms=fast"], "--switch-interval-ms must be a number"),
])
def test_bad_front_options_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_templated_chunks_equal_transformers(endpoint):
    """A stream's text chunks built from its template parse to transformers' own chunks
    (``created`` aside: the stream's first second), for texts JSON must escape."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.utils import ReasoningText

    from hf_paged.integrations.serve_stream import fast_chunks

    if endpoint == "chat":
        handler, field = ChatCompletionHandler(None, None), "content"
        call = lambda h, **kw: h._build_chunk_sse("req-1", model="m", **kw)  # noqa: E731
    else:
        handler, field = CompletionHandler(None, None), "text"
        call = lambda h, **kw: h._build_chunk_sse("req-1", "m", **kw)  # noqa: E731
    stock = type(handler)(None, None)
    fast_chunks(handler, field)

    def parsed(sse: str) -> dict:
        assert sse.startswith("data: ") and sse.endswith("\n\n")
        chunk = json.loads(sse[len("data: "):])
        chunk.pop("created")
        return chunk

    for text in ["Hello", ' "quoted" \\ back', "line\nbreak\ttab", "é 漢字 🙂", "\x01", ""]:
        assert parsed(call(handler, **{field: text})) == parsed(call(stock, **{field: text}))
    if endpoint == "chat":
        reasoning = dict(reasoning_content=ReasoningText("thinking"))
        assert parsed(call(handler, **reasoning)) == parsed(call(stock, **reasoning))
    last = dict(finish_reason="length")
    assert parsed(call(handler, **last)) == parsed(call(stock, **last))


def test_request_id_header(server):
    url, _, _ = server
    request = urllib.request.Request(f"{url}/health", headers={"X-Request-ID": "abc-123"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
        assert response.headers["X-Request-ID"] == "abc-123"
    with urllib.request.urlopen(f"{url}/health", timeout=REQUEST_TIMEOUT) as response:
        assert len(response.headers["X-Request-ID"]) == 36  # a new uuid4


def test_a_streams_first_outputs_reach_its_handler():
    """An output the engine delivers between ``add_request`` and the stream's
    ``register_result_handler`` (transformers' order) reaches the stream's handler, in order,
    not the manager's queue; a request not taken leaves no handler behind."""
    import asyncio

    from transformers.generation.continuous_batching.continuous_api import OutputRouter
    from transformers.generation.continuous_batching.requests import (
        GenerationOutput,
        RequestStatus,
    )

    from hf_paged.integrations.serve_stream import keep_first_outputs

    class Manager:  # what the placeholder needs of a continuous-batching manager
        def __init__(self):
            self.output_router = OutputRouter()

        def add_request(self, input_ids, request_id=None, **kwargs):
            if not input_ids:
                return None
            self.output_router.deliver(GenerationOutput(request_id, generated_tokens=[1]))
            return request_id

    async def main() -> tuple[list, Manager]:
        cb, seen = Manager(), []

        def start_stream():  # transformers' CBGenerateManager.generate_streaming, in short
            request_id = cb.add_request([5], request_id="r1", streaming=True)
            loop = asyncio.get_running_loop()
            cb.output_router.result_handlers[request_id] = (seen.append, loop)
            cb.output_router.deliver(GenerationOutput(request_id, generated_tokens=[1, 2],
                                                      status=RequestStatus.FINISHED))

        keep_first_outputs(cb, start_stream)
        keep_first_outputs(cb, lambda: cb.add_request([], request_id="r2"))
        await asyncio.sleep(0.05)
        return seen, cb

    seen, cb = asyncio.run(main())
    assert [o.generated_tokens for o in seen] == [[1], [1, 2]]
    assert cb.output_router.output_queue.empty()
    assert "r2" not in cb.output_router.result_handlers
    assert "add_request" not in vars(cb)  # the manager's own method is back


def test_a_lagging_stream_sends_its_pending_tokens_as_one_chunk(server):
    """While the event loop is blocked, the engine's tokens for a stream wait; the next chunk
    carries all of them (fewer text chunks than tokens), and the streamed text, joined, is
    the text the same request gets unstreamed."""
    import threading
    import time

    from hf_paged.integrations.continuous_batching import _RUNNING

    url, model, _ = server
    request = dict(model=model.name_or_path, prompt="Once upon a time", max_tokens=16)
    with openai_client(url, KEY) as c:
        whole = c.completions.create(**request)
        stream = c.completions.create(**request, stream=True,
                                      stream_options={"include_usage": True})
        chunks = [next(stream)]
        # The stream's handler runs on the server's event loop: block it while tokens come.
        manager = _RUNNING[model.engine]
        entry = manager.output_router.result_handlers.get(chunks[0].id)
        if entry is not None:  # else the request already finished: nothing to block
            blocked = threading.Event()
            entry[1].call_soon_threadsafe(lambda: (blocked.set(), time.sleep(0.5)))
            blocked.wait(5)
        chunks += list(stream)
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16
    assert len(texts) < 16, texts
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
