"""Where a streamed token's time goes in ``hf-paged serve --continuous-batching``: the server
runs in this process (transformers' app, extended as hf-paged serve extends it), the clients
in others (``serving_client``), and each server thread's CPU time over a closed loop of
``--streams`` streamed completions is divided by the tokens streamed. On the engine's thread
the time of ``EngineLoop.sync`` (tokens into transformers' request states, outputs handed to
the event loop) is timed apart; on the event loop, ``CBStreamer.put`` (detokenisation and the
hand-off to the response's queue). The rest of the event loop's time is the response: SSE
framing, JSON, HTTP writes, asyncio.

usage: python -m benchmarks.profile_serving [--model CHECKPOINT] [--streams 64]
       [--requests 512] [--max-tokens 64] [--device cpu] [--client-processes 1] [--baseline]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from benchmarks.serving_client import Phase, run_phases, split


class Timed:
    """Wall and CPU time spent in wrapped methods, by label (the CPU time is the calling
    thread's: the wall time less what it waited for, the GIL included)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def wrap(self, owner, name: str, label: str):
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
def server(model: str, device: str, dtype: str, engine_options: dict):
    """transformers serve (continuous batching) with hf_paged's patch and front, in this
    process; yields its URL."""
    from transformers.cli.serve import Serve

    import hf_paged
    from benchmarks.bench_serving import free_port
    from hf_paged.integrations import serve_front

    port = free_port()
    uninstall = serve_front.install(serve_front.FrontOptions())
    with hf_paged.patch_transformers(**engine_options):
        serve = Serve(force_model=model, device=device, dtype=dtype, continuous_batching=True,
                      host="127.0.0.1", port=port, log_level="error", non_blocking=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.kill_server()
        uninstall()


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
    parser.add_argument("--engine-option", action="append", default=[])
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
    timed = Timed()
    prompts = [" ".join(["the river runs to the sea"] * (1 + i % 4)) for i in range(args.requests)]
    requests = [(p, args.max_tokens) for p in prompts]
    with server(model, args.device, args.dtype, options) as url, \
            timed.wrap(EngineLoop, "sync", "sync"), \
            timed.wrap(EngineLoop, "step", "step"), \
            timed.wrap(CBStreamer, "put", "put"):
        warm = Phase(url, model, requests[:args.streams], time.perf_counter() + 120,
                     concurrency=args.streams)
        run_phases([warm])
        for values in (timed.seconds, timed.cpu, timed.calls):
            values.clear()
        before = thread_cpu()
        start = time.perf_counter()
        phase = Phase(url, model, requests, time.perf_counter() + 600, concurrency=args.streams)
        results = run_phases(split(phase, args.client_processes))
        wall = time.perf_counter() - start
        after = thread_cpu()
    tokens = sum(r["tokens"] or r["chunks"] for r in results if r["finished"])
    per_token = lambda s: round(s / tokens * 1e6, 1)  # noqa: E731  microseconds
    threads = {name: per_token(after[name] - before.get(name, 0.0)) for name in after
               if after[name] - before.get(name, 0.0) > 0.01 * wall}
    figures = {
        "device": args.device, "baseline": args.baseline, "streams": args.streams,
        "requests": len(results),
        "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "steps": timed.calls["step"],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "tpot_ms_p50": round(float(np.median([(r["last"] - r["first"]) / (r["chunks"] - 1)
                                              for r in results if r["chunks"] > 1])) * 1e3, 3),
        "us_per_token": {
            "thread_cpu": threads,
            # EngineLoop.step: the engine's step, then sync (inside it)
            "engine_step_with_sync_wall": per_token(timed.seconds["step"]),
            "engine_step_with_sync_cpu": per_token(timed.cpu["step"]),
            "sync_wall": per_token(timed.seconds["sync"]),
            "sync_cpu": per_token(timed.cpu["sync"]),
            "cbstreamer_put_wall": per_token(timed.seconds["put"]),
            "cbstreamer_put_cpu": per_token(timed.cpu["put"])},
    }
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


def _tiny() -> str:
    from hf_paged.random_checkpoint import make_checkpoint

    return make_checkpoint("tiny", tempfile.mkdtemp(prefix="tiny-"), dtype="float32")


if __name__ == "__main__":
    main()
