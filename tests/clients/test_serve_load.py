"""Load on hf-paged serve: thousands of requests through the ``openai`` client (async, many at
once, loopback only), a fraction of them invalid, cancelled mid-stream, with ``n`` or stop
strings; transformers' server runs in this process (the tiny checkpoint, float32 on CPU), so
the test reads the engine and the process's threads afterwards.

Every valid request's outcome (text, finish reason, usage; streamed or whole) equals the same
request's served alone, before the load; every invalid one is a 4xx naming the problem; after
the load the engine holds no KV block and no request, and the process no thread, it did not
hold before.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2 as httpx  # the HTTP client the openai client is built on
import openai
import pytest

from hf_paged.integrations.continuous_batching import _RUNNING
from hf_paged.integrations.serve_options import FrontOptions
from tests.clients.serve_helpers import REQUEST_TIMEOUT, in_process_server
from tests.conftest import SMALL

# (requests, at once) per mode: generate runs one request at a time, continuous batching all.
LOAD = {"generate": (200, 16), "continuous_batching": (2000, 64)}
MAX_TOKENS_LIMIT = 48
WORDS = "the river runs from a mountain to the sea past old towns and green fields".split()
PROMPTS = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS[:(i * 3) % 11])[:20 + 3 * i]
           for i in range(16)]
LONG = "river " * 200  # over max_model_len=128 tokens


def valid(i: int) -> tuple[str, dict, bool]:
    """Valid request ``i`` of a fixed set of 64: (endpoint, request, stream); some ask for
    ``n=2`` (transformers serve answers one choice) or carry a stop string."""
    prompt = PROMPTS[i % len(PROMPTS)]
    request: dict = dict(max_tokens=1 + i % 6)
    if i % 5 == 3:
        request["n"] = 2
    if i % 7 == 2:
        request["stop"] = [" the"]
    if i % 2:
        endpoint = "chat"
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        endpoint = "completion"
        request["prompt"] = prompt
    return endpoint, request, i % 4 < 2


VALID = [valid(i) for i in range(64)]
# Invalid requests: (endpoint, request or raw body, status, words its answer names).
INVALID = {
    "too_long": ("completion", dict(prompt=LONG, max_tokens=4), 400, "max_model_len"),
    "zero_max_tokens": ("completion", dict(prompt="Hi", max_tokens=0), 400, "max_new_tokens"),
    "over_limit": ("chat", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=999),
                   400, f"limit of {MAX_TOKENS_LIMIT}"),
    "bad_temperature": ("completion", dict(prompt="Hi", max_tokens=2, temperature="hot"), 400,
                        "temperature must be a number"),
    "unknown_model": ("completion", dict(prompt="Hi", max_tokens=2, model="no/such-model"),
                      400, "no/such-model"),
    "unknown_field": ("completion", dict(prompt="Hi", max_tokens=2, bogus=1), 422, "bogus"),
    "malformed_json": ("completion", b'{"prompt": "Hi", "max_tokens": ', 422,
                       "JSON decode error"),
}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def plan(i: int) -> tuple[str, object]:
    """Request ``i`` of the load: ("valid", index into VALID), ("cancel", index) or
    (an INVALID name, None); 70% valid, 10% cancelled, 20% invalid."""
    slot = i % 20
    if slot < 14:
        return "valid", (i * 7 + slot) % len(VALID)
    if slot < 16:
        return "cancel", i % len(PROMPTS)
    return list(INVALID)[i % len(INVALID)], None


async def outcome(client: openai.AsyncOpenAI, model: str, endpoint: str, request: dict,
                  stream: bool) -> dict:
    """A request's comparable outcome: per choice its text and finish reason, and the usage."""
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    response = await create(model=model, stream=stream, **request)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    chunks = response if stream else _one(response)
    async for chunk in chunks:
        for choice in chunk.choices:
            part = getattr(choice, "delta", None) or getattr(choice, "message", None)
            text = choice.text if part is None else part.content
            texts[choice.index] = texts.get(choice.index, "") + (text or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return {"choices": [(texts[i], finish.get(i)) for i in sorted(texts)], "usage": usage}


async def _one(response):
    yield response


async def cancelled(client: openai.AsyncOpenAI, model: str, prompt: str) -> None:
    """A stream the client leaves after its second chunk (it closes the connection)."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                             stream=True)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()


async def refused(http: httpx.AsyncClient, model: str, name: str) -> tuple[int, str]:
    endpoint, request, _, _ = INVALID[name]
    if isinstance(request, bytes):
        response = await http.post(PATHS[endpoint], content=request,
                                   headers={"content-type": "application/json"})
    else:
        response = await http.post(PATHS[endpoint], json={"model": model, **request})
    return response.status_code, response.text


async def run_load(url: str, model: str, count: int, at_once: int,
                   alone: dict[int, dict]) -> list[tuple[str, object, object]]:
    """The load: ``count`` requests, ``at_once`` in flight; returns (kind, index, outcome)."""
    limits = httpx.Limits(max_connections=at_once, max_keepalive_connections=at_once)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT,
                                  http_client=httpx.AsyncClient(limits=limits)) as client, \
            httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as http:
        gate = asyncio.Semaphore(at_once)

        async def one(i: int):
            kind, index = plan(i)
            async with gate:
                if kind == "valid":
                    endpoint, request, stream = VALID[index]
                    return kind, index, await outcome(client, model, endpoint, dict(request),
                                                      stream)
                if kind == "cancel":
                    return kind, index, await cancelled(client, model, PROMPTS[index])
                return kind, index, await refused(http, model, kind)

        return await asyncio.gather(*(one(i) for i in range(count)))


async def serve_alone(url: str, model: str) -> dict[int, dict]:
    """Each valid request's outcome served alone, one after another."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT) as client:
        return {i: await outcome(client, model, endpoint, dict(request), stream)
                for i, (endpoint, request, stream) in enumerate(VALID)}


def check(results: list[tuple[str, object, object]], alone: dict[int, dict]) -> None:
    """Every valid outcome as served alone, every invalid one its status and words."""
    for kind, index, got in results:
        if kind == "valid":
            assert got == alone[index], (VALID[index], got, alone[index])
        elif kind in INVALID:
            status, text = got
            _, _, expected_status, words = INVALID[kind]
            assert status == expected_status and words in text, (kind, status, text)
    assert len(alone[3]["choices"]) == 1  # n=2: transformers serve answers one choice


def idle(model, threads_before: int, timeout: float = 15.0) -> tuple[dict, list[str]]:
    """The engine's stats and the process's thread names once nothing runs (a cancelled
    stream's generation ends at its next token; helper threads of the server's libraries end
    when idle), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        stats = model.engine.stats()
        names = sorted(t.name for t in threading.enumerate())
        quiet = stats["num_running"] == stats["num_waiting"] == 0
        if (quiet and len(names) <= threads_before) or time.monotonic() > deadline:
            return stats, names
        time.sleep(0.05)


@pytest.mark.parametrize("mode", list(LOAD))
def test_load(mode, tiny_checkpoint):
    count, at_once = LOAD[mode]
    front = FrontOptions(max_tokens=MAX_TOKENS_LIMIT)
    with in_process_server(tiny_checkpoint, mode == "continuous_batching", front=front,
                           **SMALL) as (url, model):
        alone = asyncio.run(serve_alone(url, tiny_checkpoint))
        time.sleep(0.5)
        threads_before = sorted(t.name for t in threading.enumerate())
        stats_before = model.engine.stats()
        start = time.perf_counter()
        results = asyncio.run(run_load(url, tiny_checkpoint, count, at_once, alone))
        seconds = time.perf_counter() - start
        stats, threads = idle(model, len(threads_before))
        manager = _RUNNING.get(model.engine)
        active = None if manager is None else dict(manager.batch_processor.active)
    print(f"{mode}: {count} requests, {at_once} at once, in {seconds:.1f} s")
    check(results, alone)
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"] == stats_before["num_blocks"], stats
    assert len(threads) <= len(threads_before), (threads_before, threads)
    assert not active, active  # the continuous-batching loop holds no request either
