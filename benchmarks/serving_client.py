"""The serving benchmarks' client: streamed completions through the ``openai`` client, from
several processes (one Python process parses some tens of thousands of chunks a second, less
than a fast server sends), on one shared clock (``time.perf_counter``: CLOCK_MONOTONIC, the
same in every process of the machine).

A phase is either open (each request sent at its own start time: Poisson arrivals) or closed
(``concurrency`` clients, each sending its next request when the last one ends). Every request
streams until it ends or the phase's deadline passes (then it is cancelled: the client
disconnects) and reports when it was sent, when its first and last text chunks came, how many
chunks carried text, and the completion tokens the server counted (a chunk may carry several
tokens: a lagging server joins a stream's pending text into one chunk).

The client is the ``openai`` client (``client="openai"``), or a raw one (``"raw"``: httpx
streaming, the SSE events split but not parsed, but for the last one's usage) that costs the
client process less a chunk, to tell a client's limit from a server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.pool
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """What a client process sends: ``requests`` (prompt, max_tokens) with ``starts`` (open
    loop: absolute perf_counter times) or ``concurrency`` (closed loop), until ``deadline``."""

    url: str
    model: str
    requests: list[tuple[str, int]]
    deadline: float
    starts: list[float] | None = None
    concurrency: int = 0
    timeout: float = 600.0
    client: str = "openai"  # or "raw"


async def _stream(client, phase: Phase, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    try:
        stream = await client.completions.create(
            model=phase.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        finished = True
    except asyncio.CancelledError:
        finished = False
    except Exception as error:  # a request the server failed: reported, the phase goes on
        return {"sent": sent, "first": first, "last": last, "chunks": chunks,
                "tokens": tokens, "finished": False, "error": f"{type(error).__name__}: {error}"}
    return {"sent": sent, "first": first, "last": last, "chunks": chunks, "tokens": tokens,
            "finished": finished}


async def _stream_raw(client, phase: Phase, prompt: str, max_tokens: int) -> dict:
    """``_stream`` without the openai client: events told apart by their bytes alone."""
    sent = time.perf_counter()
    first = last = None
    chunks, tokens, buffer = 0, None, b""
    body = {"model": phase.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{phase.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for data in response.aiter_raw():
                *events, buffer = (buffer + data).split(b"\n\n")
                for event in events:
                    if b'"usage"' in event:
                        tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                    elif event.startswith(b"data: {") and b'"text":""' not in event:
                        last = time.perf_counter()
                        first = first or last
                        chunks += 1
        finished = True
    except asyncio.CancelledError:
        finished = False
    except Exception as error:
        return {"sent": sent, "first": first, "last": last, "chunks": chunks,
                "tokens": tokens, "finished": False, "error": f"{type(error).__name__}: {error}"}
    return {"sent": sent, "first": first, "last": last, "chunks": chunks, "tokens": tokens,
            "finished": finished}


async def _run(phase: Phase) -> list[dict]:
    import httpx2 as httpx  # the HTTP client the openai client is built on
    from openai import AsyncOpenAI

    many = max(len(phase.requests), 1)
    limits = httpx.Limits(max_connections=many, max_keepalive_connections=many)
    if phase.client not in ("openai", "raw"):
        raise ValueError(f"client must be 'openai' or 'raw', got {phase.client!r}")
    if phase.client == "raw":
        client = httpx.AsyncClient(limits=limits, timeout=phase.timeout)
        stream = _stream_raw
    else:
        client = AsyncOpenAI(base_url=f"{phase.url}/v1", api_key="none", max_retries=0,
                             timeout=phase.timeout, http_client=httpx.AsyncClient(limits=limits))
        stream = _stream
    async with client:
        if phase.starts is not None:
            async def timed(start: float, prompt: str, max_tokens: int) -> dict:
                await asyncio.sleep(max(0.0, start - time.perf_counter()))
                return await stream(client, phase, prompt, max_tokens)

            tasks = [asyncio.create_task(timed(s, p, n))
                     for s, (p, n) in zip(phase.starts, phase.requests)]
        else:
            queue = list(reversed(phase.requests))
            results: list[dict] = []

            async def worker() -> list[dict]:
                while queue and time.perf_counter() < phase.deadline:
                    prompt, max_tokens = queue.pop()
                    results.append(await stream(client, phase, prompt, max_tokens))
                return results

            tasks = [asyncio.create_task(worker()) for _ in range(phase.concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, phase.deadline -
                                                              time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if phase.starts is not None:
            return [t.result() for t in done]
        return results


def _ready(_: int) -> None:
    import httpx2  # noqa: F401  imported before the clock starts, as the openai client
    import openai  # noqa: F401


@contextlib.contextmanager
def client_pool(processes: int) -> Iterator[multiprocessing.pool.Pool]:
    """``processes`` client processes, started and their imports done before it yields: a
    spawned process imports its parent's main module (a benchmark's: torch, transformers)
    for seconds, which must not fall inside a phase's clock."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_ready, range(processes), chunksize=1)
        yield pool


def _run_phase(phase: Phase) -> tuple[list[dict], dict]:
    _ready(0)
    cpu, start = time.process_time(), time.perf_counter()
    results = asyncio.run(_run(phase))
    return results, {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - start,
                     "chunks": sum(r["chunks"] for r in results)}


def run_phases(phases: list[Phase], processes: list[dict] | None = None,
               pool: multiprocessing.pool.Pool | None = None) -> list[dict]:
    """Each phase in a process of its own (of ``pool``, from ``client_pool``, else new ones),
    all at once; every request's outcome. Each process's CPU and wall seconds and the text
    chunks it received go to ``processes``."""
    if pool is None:
        with client_pool(len(phases)) as pool:
            return run_phases(phases, processes, pool)
    parts = pool.map(_run_phase, phases, chunksize=1)
    if processes is not None:
        processes.extend(figures for _, figures in parts)
    return [r for part, _ in parts for r in part]


def split(phase: Phase, processes: int) -> list[Phase]:
    """``phase`` dealt out round-robin to ``processes`` client processes (a closed loop's
    clients too)."""
    processes = max(1, min(processes, len(phase.requests)))
    parts = []
    for k in range(processes):
        starts = None if phase.starts is None else phase.starts[k::processes]
        concurrency = len(range(k, phase.concurrency, processes)) if phase.concurrency else 0
        parts.append(Phase(phase.url, phase.model, phase.requests[k::processes], phase.deadline,
                           starts, concurrency, phase.timeout, phase.client))
    return parts
