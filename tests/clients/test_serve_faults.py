"""hf-paged serve as a process (``python -m hf_paged serve --continuous-batching`` on the tiny
checkpoint, float32 on CPU, 127.0.0.1), with its engine in the server's process and in one of
its own (``--engine-process``): SIGTERM while streams are open, a tensor-parallel worker (TP=2
over gloo) killed while streams are open, and (engine process) the load test's requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.clients.serve_helpers import MODEL, ServerProcess, hub_cache, server_env
from tests.conftest import SMALL

STREAMS, MAX_TOKENS = 16, 40
EXIT_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    return server_env(hub_cache(tmp_path_factory.mktemp("faults") / "hub", tiny_checkpoint))


def start(env: dict[str, str], log: Path, split: bool, *engine_options: str,
          serve_args: tuple[str, ...] = ()) -> ServerProcess:
    options = [*(f"{k}={v}" for k, v in SMALL.items()), *engine_options]
    return ServerProcess([sys.executable, "-m", "hf_paged", "serve", MODEL, "--device", "cpu",
                          "--dtype", "float32", "--continuous-batching",
                          *(["--engine-process"] if split else []), *serve_args,
                          *(f"--engine-option={o}" for o in options)], env, log)


SPLIT = pytest.mark.parametrize("split", [False, True], ids=["one_process", "engine_process"])


async def open_streams(url: str, fault, ended: set[int] | None = None) -> list[tuple]:
    """``STREAMS`` streamed completions; once every one has its first chunk, ``fault()``;
    each stream's outcome: ("done", chunks, finish reason, completion tokens) or ("error",
    the exception's type, what it carried). ``ended`` gets the streams that had ended before
    the fault (a fast server may finish one while another waits for its first chunk)."""
    firsts = [asyncio.Event() for _ in range(STREAMS)]

    async def stream(client: openai.AsyncOpenAI, i: int) -> tuple:
        try:
            chunks = await client.completions.create(
                model=MODEL, prompt="the river " * (1 + i % 5), max_tokens=MAX_TOKENS,
                stream=True, stream_options={"include_usage": True})
            count, finish, usage = 0, None, None
            async for chunk in chunks:
                firsts[i].set()
                count += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            return "done", count, finish, usage and usage.completion_tokens
        except openai.APIError as error:
            firsts[i].set()
            return "error", type(error).__name__, str(error.body or error)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        if ended is not None:
            ended.update(i for i, task in enumerate(tasks) if task.done())
        fault()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)


def check_failed(outcomes: list[tuple], ended: set[int], named: str, server) -> None:
    """Every stream still open at the fault (most of them) failed with an error naming it."""
    open_ = [o for i, o in enumerate(outcomes) if i not in ended]
    assert len(open_) >= STREAMS // 2, (outcomes, ended)
    assert all(o[0] == "error" and named in o[2] for o in open_), (outcomes, server.log_tail())


@SPLIT
def test_sigterm_finishes_open_streams_and_exits(env, tmp_path, split):
    """SIGTERM with streams open: the server stops taking connections, every open stream
    ends with all its tokens, and the process exits (uvicorn re-raises the signal once it
    has shut down); an engine process exits with it."""
    server = start(env, tmp_path / "server.log", split)
    engines: list[int] = []

    def terminate() -> None:
        engines.extend(children(server.process.pid))
        server.process.send_signal(signal.SIGTERM)

    try:
        url = server.url()
        outcomes = asyncio.run(open_streams(url, terminate))
        returncode = server.process.wait(timeout=EXIT_TIMEOUT)
    finally:
        server.stop()
    assert all(o[0] == "done" and o[2] == "length" and o[3] == MAX_TOKENS for o in outcomes), (
        outcomes, server.log_tail())
    assert returncode in (0, -signal.SIGTERM), server.log_tail()
    assert "Application shutdown complete" in server.log_tail()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=2)
    assert len(engines) == int(split)
    for pid in engines:
        _wait_gone(pid)


def children(pid: int) -> list[int]:
    return [int(child) for task in os.listdir(f"/proc/{pid}/task")
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, then theirs (an engine process's ranks), in that order."""
    out = []
    for child in children(pid):
        out += [child, *_descendants(child)]
    return out


def _wait_gone(pid: int, timeout: float = EXIT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and not _zombie(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@SPLIT
def test_killed_tensor_parallel_worker_fails_streams_and_health_says_so(env, tmp_path, split):
    """TP=2 over gloo: the worker rank killed with streams open fails every one of them with
    an error naming the dead rank; /health answers 503 naming it, and a new request a 503."""
    server = start(env, tmp_path / "server.log", split, "tensor_parallel_size=2")
    try:
        url = server.url()
        assert health(url) == (200, {"status": "ok"})
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as client:  # an engine process loads on first use
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        (worker,) = _descendants(server.process.pid)[-1:]
        ended: set[int] = set()
        outcomes = asyncio.run(open_streams(url, lambda: os.kill(worker, signal.SIGKILL), ended))
        status, body = health(url)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=30) as client, pytest.raises(openai.APIStatusError) as late:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    finally:
        server.stop()
    named = f"rank 1 (pid {worker}) was killed by SIGKILL"
    check_failed(outcomes, ended, named, server)
    assert status == 503 and body["reason"] in ("engine_broken", "cb_worker_dead"), body
    assert named in body["error"], body
    assert late.value.status_code == 503 and named in late.value.response.text


def test_engine_process_under_load(env, tmp_path):
    """The load test's requests (fewer) through hf-paged serve --engine-process: every valid
    one as served alone, every invalid one a 4xx naming the problem; afterwards the engine
    (read through /metrics) holds no block and runs or queues no request."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.clients import test_serve_load as load

    server = start(env, tmp_path / "server.log", True,
                   serve_args=(f"--max-tokens={load.MAX_TOKENS_LIMIT}",))
    try:
        url = server.url()
        alone = asyncio.run(load.serve_alone(url, MODEL))
        results = asyncio.run(load.run_load(url, MODEL, 400, 32, alone))
        time.sleep(1.0)  # a cancelled stream's generation ends at its next token
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    load.check(results, alone)
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["hf_paged_kv_blocks_used"] == 0, samples
    assert samples["hf_paged_requests_running"] == samples["hf_paged_requests_waiting"] == 0


def test_killed_engine_process_fails_streams_and_health_says_so(env, tmp_path):
    """--engine-process: the engine's process killed with streams open fails every one of
    them with an error saying so; /health answers 503 naming it."""
    server = start(env, tmp_path / "server.log", True)
    try:
        url = server.url()
        (engine,) = children(server.process.pid)
        ended: set[int] = set()
        outcomes = asyncio.run(open_streams(url, lambda: os.kill(engine, signal.SIGKILL), ended))
        status, body = health(url)
    finally:
        server.stop()
    named = f"the engine process exited (code {-signal.SIGKILL})"
    check_failed(outcomes, ended, named, server)
    assert status == 503 and body == {"status": "unhealthy", "reason": "cb_worker_dead",
                                      "error": named}, body
