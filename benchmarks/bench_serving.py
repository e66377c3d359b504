"""Online serving at W1's scale: W1's 256 requests (its prompt and output lengths, text
prompts, greedy, streamed through the ``openai`` client from ``--client-processes`` processes)
arriving as a Poisson process at several rates, then sent by closed loops of 64 and 256
concurrent clients, through the OpenAI-compatible ``/v1/completions`` of ``hf-paged serve
--continuous-batching`` (with ``--engine-process``, and without: one process) and of stock
``transformers serve --continuous-batching`` (the same server on stock transformers), one
after the other in the same run: requests per second served,
output tokens per second, time to first token and time per output token (p50, p99). Every phase
is bounded in time (``--phase-timeout``, ``--baseline-phase-timeout``: requests still open then
are cancelled, and the phase says ``timed_out``), and the run by ``--time-budget`` (phases it
leaves no time for are skipped, saying so). After each of hf-paged serve's phases its
``/metrics`` are read (preemptions, prefix-cache hit rate, tokens). Stock transformers serve
streams a W1 request's token about every 150 ms on an H100, so it finishes none of W1's phases
in bounded time: with ``--baseline-requests N [N ...]`` it runs, for each N, one phase of W1's
first N requests at once, cut to ``--baseline-max-output`` new tokens (its offered loads), and
each hf-paged serve run adds those phases after its own, so the two compare on the same
requests. Writes
``serving-<device>.json``; ``benchmarks.serving_report`` makes the table and the plot.

usage: python -m benchmarks.bench_serving --model CHECKPOINT [--rates 8 16 32 64]
       [--concurrency 64 256] [--num-requests 256]
       [--systems hf_paged_engine_process transformers hf_paged]
       [--phase-timeout 90] [--baseline-phase-timeout 25] [--time-budget 520]
       [--client-processes 4] [--client openai] [--serve-arg=--switch-interval-ms=0.5]
       [--baseline-requests 4 16 64 --baseline-max-output 128 --baseline-phase-timeout 60]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.common import device_info, git_commit, write_result
from benchmarks.serving_client import Phase, client_pool, run_phases, split
from benchmarks.serving_servers import decodable_copy, free_port, scrape, server_command, wait_ready
from benchmarks.workloads import MAX_TOKEN_ID, w1

ROOT = Path(__file__).resolve().parent.parent


def summarize(results: list[dict], offered: dict, begin: float, deadline: float,
              count: int, clients: list[dict] = ()) -> dict:
    """A phase's figures: what was offered, served, and how fast; tokens as the server
    counted them (the stream's usage), else the text chunks. A chunk may carry several tokens
    (the server joins a lagging stream's pending text), so time per output token is counted
    per token, as vLLM's benchmark does: (last text chunk's time - first's) / (tokens - 1).
    ``clients``: each client process's CPU and wall seconds and chunks; one near a CPU second
    a second is the phase's limit, not the server."""
    done = [r for r in results if r["finished"] and r["first"] is not None]
    failed = [r for r in results if r.get("error")]
    end = max((r["last"] for r in done), default=deadline)
    first_sent = min((r["sent"] for r in results if r.get("sent") is not None), default=begin)
    wall = max(end - min(begin, first_sent), 1e-9)  # a closed loop sends as soon as it can
    counted = lambda r: r["tokens"] if r["tokens"] is not None else r["chunks"]  # noqa: E731
    tokens = sum(counted(r) for r in done)
    ttft = np.array([r["first"] - r["sent"] for r in done]) * 1e3
    tpot = np.array([(r["last"] - r["first"]) / (counted(r) - 1) for r in done
                     if r["chunks"] > 1 and counted(r) > 1]) * 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if len(a) else None  # noqa: E731
    return {
        **offered, "requests": count, "completed": len(done), "failed": len(failed),
        "timed_out": len(done) + len(failed) < count,
        "errors": sorted({r["error"] for r in failed})[:5],
        "wall_s": round(wall, 2), "requests_per_s": round(len(done) / wall, 3),
        # how late the first request left against the phase's clock (the clients' lag)
        "first_sent_s": round(first_sent - begin, 3),
        "output_tok_per_s": round(tokens / wall, 1),
        "output_chunks_per_s": round(sum(r["chunks"] for r in done) / wall, 1),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
        "client_processes": [{"cpu_s_per_s": round(c["cpu_s"] / max(c["wall_s"], 1e-9), 2),
                              "chunks_per_s": round(c["chunks"] / max(c["wall_s"], 1e-9), 1)}
                             for c in clients],
    }


def run_phase(url: str, args, requests: list[tuple[str, int]], timeout: float,
              rate: float | None = None, concurrency: int | None = None) -> dict:
    """One phase: Poisson arrivals at ``rate`` requests/s (``inf``: all at once), or a closed
    loop of ``concurrency`` clients; bounded by ``timeout`` seconds."""
    with client_pool(min(args.client_processes, len(requests))) as pool:
        # the client processes are up: the clock starts now
        begin = time.perf_counter() + 0.2
        phase, offered = _phase(url, args, requests, begin, timeout, rate, concurrency)
        clients: list[dict] = []
        results = run_phases(split(phase, args.client_processes), clients, pool)
    return summarize(results, offered, begin, begin + timeout, len(requests), clients)


def _phase(url: str, args, requests: list[tuple[str, int]], begin: float, timeout: float,
           rate: float | None, concurrency: int | None) -> tuple[Phase, dict]:
    """The phase ``run_phase`` describes, starting at ``begin``, and what it offers."""
    deadline = begin + timeout
    if rate is not None:
        rng = random.Random(int(rate) if rate != float("inf") else 0)
        starts, t = [], begin
        for _ in requests:
            starts.append(t)
            t += 0.0 if rate == float("inf") else rng.expovariate(rate)
        phase = Phase(url, args.model, requests, deadline, starts=starts,
                      timeout=args.request_timeout, client=args.client)
        offered = {"rate_requests_per_s": rate}
    else:
        phase = Phase(url, args.model, requests, deadline, concurrency=concurrency,
                      timeout=args.request_timeout, client=args.client)
        offered = {"concurrency": concurrency}
    return phase, offered


def measure(system: str, args, requests: list[tuple[str, int]]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(system, args.model, port, args.engine_option, args.serve_arg)
    timeout = args.baseline_phase_timeout if system == "transformers" else args.phase_timeout
    log = open(args.results_dir / f"serve-{system}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  [str(ROOT), os.environ.get("PYTHONPATH", "")])),
                              start_new_session=True)
    started = time.perf_counter()
    phases: list[dict] = []
    run = {"command": command[3:] if system == "transformers" else command[1:],
           "phase_timeout_s": timeout, "phases": phases}
    try:
        wait_ready(url, args.model, time.monotonic() + args.start_timeout)
        run["ready_s"] = round(time.perf_counter() - started, 1)
        print(f"serving {system}: ready in {run['ready_s']} s", flush=True)
        plan = [dict(rate=r) for r in args.rates] + [dict(concurrency=c)
                                                     for c in args.concurrency]
        if args.baseline_requests:  # stock runs only the same-requests phases, last for ours
            plan = [] if system == "transformers" else plan
            plan += [dict(concurrency=n, same=n) for n in args.baseline_requests]
        for offered in plan:
            left = args.end - time.monotonic() - 5.0  # 5 s to stop the server
            same = offered.pop("same", 0)
            if left < 10.0:
                phases.append({**offered, "skipped": "the run's --time-budget was spent"})
                continue
            figures = run_phase(url, args, same_requests(args, requests, same) if same
                                else requests, min(timeout, left), **offered)
            if same:
                figures.update(baseline_requests=same,
                               baseline_max_output=args.baseline_max_output)
            metrics = scrape(url)
            if metrics:
                figures["server_metrics"] = {k: v for k, v in metrics.items()
                                             if k.split("_le_")[0] in SCRAPED}
            print(f"serving {system} {offered}: {figures}", flush=True)
            phases.append(figures)
        return run
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def same_requests(args, requests: list[tuple[str, int]], count: int) -> list[tuple[str, int]]:
    """The first ``count`` requests, each cut to ``--baseline-max-output`` new tokens: a phase
    stock transformers serve finishes in bounded time, sent to every server all at once, so
    that the two compare on the same requests."""
    return [(prompt, min(n, args.baseline_max_output)) for prompt, n in requests[:count]]


# hf-paged serve with its engine in a process of its own, stock transformers serve, and
# hf-paged serve in one process (engine loop and event loop sharing the GIL).
SYSTEMS = ("hf_paged_engine_process", "transformers", "hf_paged")
# What the result keeps of hf-paged serve's /metrics after each phase.
SCRAPED = {"hf_paged_preemptions_total", "hf_paged_kv_blocks_total",
           "hf_paged_prefix_cache_hit_rate", "hf_paged_generation_tokens_total",
           "hf_paged_requests_finished_total"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rates", type=float, nargs="*", default=[8.0, 16.0, 32.0, 64.0],
                        help="Poisson arrival rates, requests/s (inf: all at once)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[64, 256],
                        help="closed loops of this many clients")
    parser.add_argument("--num-requests", type=int, default=256, help="W1's first N")
    parser.add_argument("--max-input-len", type=int, default=1024, help="W1's: 1024")
    parser.add_argument("--max-output-len", type=int, default=1024, help="W1's: 1024")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="run in this order (the time budget may cut the last short)")
    parser.add_argument("--engine-option", action="append", default=[],
                        help="KEY=VALUE for hf-paged serve's engine")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an argument for hf-paged serve alone, e.g. "
                             "--serve-arg=--switch-interval-ms=0.5")
    parser.add_argument("--phase-timeout", type=float, default=90,
                        help="seconds a phase of hf-paged serve may take")
    parser.add_argument("--baseline-phase-timeout", type=float, default=25,
                        help="seconds a phase of transformers serve may take (it serves a few "
                             "requests a minute at W1's lengths)")
    parser.add_argument("--baseline-requests", type=int, nargs="*", default=[],
                        help="stock transformers serve runs only, for each N, W1's first N "
                             "requests (cut to --baseline-max-output tokens) at once, and "
                             "hf-paged serve those phases too, after its own")
    parser.add_argument("--baseline-max-output", type=int, default=128)
    parser.add_argument("--time-budget", type=float, default=520,
                        help="seconds for the whole run: phases that would pass it are skipped")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="client processes (each reports its CPU use: one near a CPU "
                             "second a second limits the phase)")
    parser.add_argument("--client", choices=("openai", "raw"), default="openai",
                        help="the openai client, or httpx with the SSE events split but not "
                             "parsed (less CPU a chunk)")
    parser.add_argument("--start-timeout", type=float, default=240)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.end = time.monotonic() + args.time_budget
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.model = decodable_copy(args.model, Path(f"{args.model.rstrip('/')}-decodable"),
                                len(tokenizer))
    workload = w1(max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                  max_token_id=min(MAX_TOKEN_ID, len(tokenizer) - 1)).head(args.num_requests)
    # Text prompts: W1's token ids decoded (re-encoding may differ by a few tokens).
    prompts = [tokenizer.decode(ids) for ids in workload.prompts]
    lengths = list(workload.max_new_tokens)
    info = device_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    path = args.results_dir / f"serving-{info['slug']}.json"
    result = {
        "workload": "serving", "git_commit": git_commit(), "device": info,
        "checkpoint": args.model, "num_requests": args.num_requests,
        "max_input_len": args.max_input_len, "max_output_len": args.max_output_len,
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "max_output_tokens": sum(lengths), "arrivals": "Poisson, and closed loops",
        "client_processes": args.client_processes, "client": args.client, "runs": {},
    }
    for system in args.systems:
        try:
            result["runs"][system] = measure(system, args, list(zip(prompts, lengths)))
        except Exception as error:  # a server that fails is reported, the other still runs
            result["runs"][system] = {"error": f"{type(error).__name__}: {error}"}
            print(f"serving {system} failed: {result['runs'][system]['error']}", flush=True)
        write_result(path, result)  # after each system: a run cut short keeps what it had
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
