"""hf-paged serve ``--data-parallel-size 2`` (transformers' server in this process, two engine
processes on CPU): concurrent streams spread over both replicas, each as served alone; one
replica killed with streams open fails its own streams by name while the other's finish,
``/health`` stays ok and later requests are served; no engine process is left behind."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

from hf_paged.integrations.serve_options import FrontOptions, take_front_options
from tests.clients.serve_helpers import in_process_server
from tests.clients.test_serve_faults import health
from tests.conftest import SMALL

STREAMS, MAX_TOKENS = 8, 40


async def streams(url: str, model: str, fault=None) -> list[tuple]:
    """``STREAMS`` streamed completions; once each has its first chunk, ``fault()``; each
    one's ("done", text) or ("error", what the error carried)."""
    firsts = [asyncio.Event() for _ in range(STREAMS)]

    async def stream(client: openai.AsyncOpenAI, i: int) -> tuple:
        text = ""
        try:
            chunks = await client.completions.create(
                model=model, prompt="the river " * (1 + i % 3), max_tokens=MAX_TOKENS,
                temperature=0.0, stream=True)
            async for chunk in chunks:
                firsts[i].set()
                text += chunk.choices[0].text if chunk.choices else ""
            return "done", text
        except openai.APIError as error:
            firsts[i].set()
            return "error", str(error.body or error)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(STREAMS)]
        if fault is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
            fault()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)


def test_requests_spread_over_replicas_and_a_dead_one_fails_only_its_own(tiny_checkpoint):
    front = FrontOptions(data_parallel_size=2)
    with in_process_server(tiny_checkpoint, True, front=front, **SMALL) as (url, model):
        processes = [p.process for p in model.processes]
        served = asyncio.run(streams(url, tiny_checkpoint))
        assert all(kind == "done" for kind, _ in served), served
        queries = [p.call("stats")[0]["prefix_cache_queries"] for p in model.processes]
        assert all(q > 0 for q in queries), queries  # both replicas took requests
        manager = model.manager
        victim = processes[1]
        held: list[str] = []

        def kill() -> None:
            held.extend(r for r, owner in manager.owner.items() if owner == 1)
            os.kill(victim.pid, signal.SIGKILL)

        outcomes = asyncio.run(streams(url, tiny_checkpoint, kill))
        named = f"data-parallel replica 1 (pid {victim.pid}) exited (code {-signal.SIGKILL})"
        failed = [o for o in outcomes if o[0] == "error"]
        # its open streams (one may have had its last tokens on the way when it died)
        assert 1 <= len(failed) <= len(held) < STREAMS, outcomes
        assert all(named in why for _, why in failed), failed
        assert health(url) == (200, {"status": "ok"})
        later = asyncio.run(streams(url, tiny_checkpoint))
        assert all(kind == "done" for kind, _ in later), later
        assert later == served  # greedy: as before, all on the live replica now
    assert all(p.poll() is not None for p in processes)


def test_data_parallel_size_flag():
    options, rest = take_front_options(["m", "--data-parallel-size", "2",
                                        "--continuous-batching"])
    assert options.data_parallel_size == 2 and rest == ["m", "--continuous-batching"]
    with pytest.raises(ValueError, match="--data-parallel-size serves with --continuous-batch"):
        take_front_options(["m", "--data-parallel-size=2"])
    with pytest.raises(ValueError, match="--data-parallel-size must be a positive integer"):
        take_front_options(["m", "--data-parallel-size=0", "--continuous-batching"])
