"""Where a streamed token's time goes in ``hf-paged serve --continuous-batching``: the server
runs in this process (transformers' app, extended as hf-paged serve extends it; its engine
in another with ``--engine-process``), the clients in others (``serving_client``: the
``openai`` client, or ``--client raw``), and the server process's CPU time, and each of its
threads', over a closed loop of ``--streams`` streamed completions is divided by the tokens
streamed. On the engine's thread (one process) the time of ``EngineLoop.sync`` (tokens into
transformers' request states, outputs handed to the event loop) is timed apart; on the event
loop, ``CBStreamer.put`` (detokenisation and the hand-off to the response's queue). The rest
of the event loop's time is the response: SSE framing, JSON, HTTP writes, asyncio;
``--cprofile N`` lists the event loop's N costliest functions (cProfile, that thread only).

``--fake-step-ms MS`` serves from an engine whose model costs nothing (``fake_steps``: the
engine's host side is real, a step takes MS after the last with the GIL released, every
sampled token is text): tokens come far faster than a server streams them, as from a GPU, so
what the server delivers is its own limit. Figures: tokens and text chunks a second (a chunk
carries several tokens when the server joins a stream's pending text), the server process's
CPU a token (and the engine process's, with ``--engine-process``), each client process's CPU
and chunks a second (a client process near one CPU second a second is the limit, not the
server), and time per output token, per token: (last text chunk's time - first's) /
(tokens - 1). On a machine whose cores are shared, the CPU a token is the figure to compare.

usage: python -m benchmarks.profile_serving [--model CHECKPOINT] [--streams 64]
       [--requests 512] [--max-tokens 64] [--device cpu] [--client-processes 1] [--baseline]
       [--fake-step-ms MS] [--engine-process] [--client raw] [--cprofile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from benchmarks.serving_client import Phase, run_phases, split


class Timed:
    """Wall and CPU time spent in wrapped methods, by label (the CPU time is the calling
    thread's: the wall time less what it waited for, the GIL included)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def wrap(self, owner, name: str, label: str):
        if not self.enabled:
            yield
            return
        stock = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return stock(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.cpu[label] += time.thread_time() - cpu
                self.calls[label] += 1

        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, stock)


def children_cpu() -> dict[int, float]:
    """CPU seconds (user and system) of each child process of this one, by pid (Linux)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():  # ppid; then utime, stime at 11, 12
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name."""
    out = {}
    for thread in threading.enumerate():
        try:
            out[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):
            pass
    return out


@contextmanager
def server(model: str, device: str, dtype: str, engine_options: dict,
           engine_process: bool = False):
    """transformers serve (continuous batching) with hf_paged's patch and front, in this
    process (the engine in another with ``engine_process``); yields its URL and the event
    loop."""
    from transformers.cli.serve import Serve

    import hf_paged
    from benchmarks.serving_servers import free_port
    from hf_paged.integrations import serve_front
    from hf_paged.integrations.serve_options import FrontOptions

    port = free_port()
    uninstall = serve_front.install(FrontOptions(engine_process=engine_process))
    with hf_paged.patch_transformers(**engine_options):
        serve = Serve(force_model=model, device=device, dtype=dtype, continuous_batching=True,
                      host="127.0.0.1", port=port, log_level="error", non_blocking=True)
    try:
        while not serve.server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", serve.server.servers[0].get_loop()
    finally:
        serve.kill_server()
        uninstall()


@contextmanager
def fake_steps(step_ms: float | None, model: str):
    """Engines loaded meanwhile, here or in an engine process, run ``fake_steps``'s steps of
    ``step_ms`` (None: the model's own)."""
    if step_ms is None:
        yield
        return
    from transformers import AutoTokenizer

    from benchmarks import fake_steps as fake
    from hf_paged.integrations import engine_process

    tokens = fake.text_tokens(AutoTokenizer.from_pretrained(model))
    stock_child = engine_process._CHILD
    os.environ[fake.FAKE_STEPS_ENV] = json.dumps({"step_ms": step_ms, "token_ids": tokens})
    uninstall = fake.install(step_ms, tokens)
    engine_process._CHILD = "from benchmarks.fake_steps import child; child()"
    try:
        yield
    finally:
        uninstall()
        engine_process._CHILD = stock_child
        del os.environ[fake.FAKE_STEPS_ENV]


@contextmanager
def profiled(loop, top: int, into: dict):
    """cProfile on ``loop``'s thread meanwhile (nothing when ``top`` is 0); its ``top``
    costliest functions by own time, as text, into ``into["event_loop_profile"]``."""
    if not top:
        yield
        return
    profile = cProfile.Profile()

    def on_loop(call) -> None:
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (call(), done.set()))
        done.wait(30)

    on_loop(profile.enable)
    try:
        yield
    finally:
        on_loop(profile.disable)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
        into["event_loop_profile"] = out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: a tiny random one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else
                        "float32")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--client", choices=("openai", "raw"), default="openai")
    parser.add_argument("--engine-option", action="append", default=[])
    parser.add_argument("--engine-process", action="store_true",
                        help="the engine in a process of its own (hf-paged serve's flag)")
    parser.add_argument("--fake-step-ms", type=float,
                        help="an engine whose steps take this long and run no model")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="the event loop's N costliest functions (cProfile)")
    parser.add_argument("--no-call-timers", action="store_true",
                        help="time no calls apart (the timers cost the event loop a few us "
                             "a token)")
    parser.add_argument("--baseline", action="store_true",
                        help="transformers' own chunk building and request-id middleware "
                             "(hf-paged serve's serve_stream changes off), to compare")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="the interpreter's thread switch interval in the server (Python's "
                             "default: 5 ms)")
    parser.add_argument("--out", help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    from transformers.cli.serving.utils import CBStreamer

    from hf_paged.integrations.continuous_batching_engine import EngineLoop
    from hf_paged.integrations.serve import parse_engine_option

    if args.baseline:
        from hf_paged.integrations import serve_stream

        serve_stream.fast_chunks = lambda handler, text_field: None
        serve_stream.replace_request_id_middleware = lambda app: False
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    model = args.model or _tiny()
    options = dict(parse_engine_option(o) for o in args.engine_option)
    timed = Timed(not args.no_call_timers)
    prompts = [" ".join(["the river runs to the sea"] * (1 + i % 4)) for i in range(args.requests)]
    requests = [(p, args.max_tokens) for p in prompts]
    figures: dict = {}
    clients: list[dict] = []
    with fake_steps(args.fake_step_ms, model), \
            server(model, args.device, args.dtype, options, args.engine_process) as (url, loop), \
            timed.wrap(EngineLoop, "sync", "sync"), \
            timed.wrap(EngineLoop, "step", "step"), \
            timed.wrap(CBStreamer, "put", "put"):
        warm = Phase(url, model, requests[:args.streams], time.perf_counter() + 120,
                     concurrency=args.streams, client=args.client)
        run_phases([warm])
        for values in (timed.seconds, timed.cpu, timed.calls):
            values.clear()
        phase = Phase(url, model, requests, time.perf_counter() + 600, concurrency=args.streams,
                      client=args.client)
        with profiled(loop, args.cprofile, figures):
            before, process, engines = thread_cpu(), time.process_time(), children_cpu()
            results = run_phases(split(phase, args.client_processes), clients)
            after, process = thread_cpu(), time.process_time() - process
            engine_cpu = sum(children_cpu().get(pid, cpu) - cpu for pid, cpu in engines.items())
    done = [r for r in results if r["finished"]]
    # From the first request sent to the last token received (the client processes' start
    # is not the server's time).
    wall = max(r["last"] or r["sent"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] or r["chunks"] for r in done)
    chunks = sum(r["chunks"] for r in done)
    per_token = lambda s: round(s / tokens * 1e6, 1)  # noqa: E731  microseconds
    threads = {name: per_token(after[name] - before.get(name, 0.0)) for name in after
               if after[name] - before.get(name, 0.0) > 0.01 * wall}
    engine_here = {
        # EngineLoop.step: the engine's step, then sync (inside it)
        "engine_step_with_sync_wall": per_token(timed.seconds["step"]),
        "engine_step_with_sync_cpu": per_token(timed.cpu["step"]),
        "sync_wall": per_token(timed.seconds["sync"]),
        "sync_cpu": per_token(timed.cpu["sync"])}
    figures = {
        "device": args.device, "baseline": args.baseline, "streams": args.streams,
        "engine_process": args.engine_process, "fake_step_ms": args.fake_step_ms,
        "client": args.client, "requests": len(results), "finished": len(done),
        "tokens": tokens, "chunks": chunks, "tokens_per_chunk": round(tokens / chunks, 2),
        "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "chunks_per_s": round(chunks / wall, 1), "steps": timed.calls["step"],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "server_cpu_s_per_s": round(process / wall, 2),
        **({"engine_process_cpu_s_per_s": round(engine_cpu / wall, 2)}
           if args.engine_process else {}),
        "ttft_ms_p50": round(float(np.median([r["first"] - r["sent"] for r in done
                                              if r["first"] is not None])) * 1e3, 1),
        "tpot_ms_p50": round(float(np.median([(r["last"] - r["first"]) / (r["tokens"] - 1)
                                              for r in done if (r["tokens"] or 0) > 1
                                              and r["chunks"] > 1])) * 1e3, 3),
        "client_processes": [{"cpu_s_per_s": round(c["cpu_s"] / c["wall_s"], 2),
                              "chunks_per_s": round(c["chunks"] / c["wall_s"], 1)}
                             for c in clients],
        "us_per_token": {
            "server_process_cpu": per_token(process),
            **({"engine_process_cpu": per_token(engine_cpu)} if args.engine_process else {}),
            "thread_cpu": threads,
            **({} if args.engine_process else engine_here),
            "cbstreamer_put_wall": per_token(timed.seconds["put"]),
            "cbstreamer_put_cpu": per_token(timed.cpu["put"])},
        **figures,
    }
    profile = figures.pop("event_loop_profile", None)
    print(json.dumps(figures, indent=1))
    if profile:
        print(profile)
        figures["event_loop_profile"] = profile
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


def _tiny() -> str:
    from hf_paged.random_checkpoint import make_checkpoint

    return make_checkpoint("tiny", tempfile.mkdtemp(prefix="tiny-"), dtype="float32")


if __name__ == "__main__":
    main()
