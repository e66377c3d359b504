"""Online serving: requests arriving as a Poisson process at several rates, with W1's prompt
and output lengths, through the OpenAI-compatible ``/v1/completions`` of ``transformers serve
--continuous-batching`` on stock transformers and of ``hf-paged serve --continuous-batching``
(the same server, Qwen3 checkpoints on hf_paged), one after the other in the same run: requests
per second served, time to first token and time per output token (p50, p99). Writes
``serving-<device>.json``.

usage: python -m benchmarks.bench_serving --model CHECKPOINT [--rates 1 4 16]
       [--num-requests 32] [--systems transformers hf_paged]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.common import device_info, git_commit, write_result
from benchmarks.workloads import MAX_TOKEN_ID, w1

ROOT = Path(__file__).resolve().parent.parent


def server_command(system: str, model: str, port: int, engine_options: list[str]) -> list[str]:
    common = [model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
              "--dtype", "bfloat16", "--log-level", "warning"]
    if system == "transformers":
        return [sys.executable, "-c", "from transformers.cli.transformers import main; main()",
                "serve", *common]
    options = [a for o in engine_options for a in ("--engine-option", o)]
    return [sys.executable, "-m", "hf_paged", "serve", *common, *options]


def decodable_copy(model: str, out: Path, tokenizer_size: int) -> str:
    """The checkpoint with the LM head's rows past the tokenizer's ids zeroed (the embedding's
    too, when they are tied): the model then generates only tokens the tokenizer decodes, so
    every token reaches the client as text, at the same shapes and cost. Random checkpoints
    come with a 1,024-id tokenizer for a 151,936-id model; most of what they generate would
    otherwise stream nothing."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        return str(out)
    shutil.copytree(model, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name in tensors:
                tensors[name][tokenizer_size:] = 0
        save_file(tensors, str(file), metadata={"format": "pt"})
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(client, model: str, deadline: float) -> None:
    """Until the server answers a one-token completion (the model loaded, warmed up)."""
    while True:
        try:
            await client.completions.create(model=model, prompt="Hello", max_tokens=2)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(2)


async def one_request(client, model: str, prompt: str, max_tokens: int, start: float) -> dict:
    """Stream one completion; the times of its first and last text chunks."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    sent = time.perf_counter()
    first = last = None
    chunks = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0.0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            chunks += 1
    return {"sent": sent, "first": first, "last": last, "chunks": chunks}


async def run_rate(client, model: str, prompts: list[str], lengths: list[int], rate: float,
                   seed: int) -> dict:
    rng = random.Random(seed)
    begin = time.perf_counter() + 0.5
    starts, t = [], begin
    for _ in prompts:
        starts.append(t)
        t += rng.expovariate(rate)
    results = await asyncio.gather(*(one_request(client, model, p, n, s)
                                     for p, n, s in zip(prompts, lengths, starts)))
    done = [r for r in results if r["first"] is not None]
    wall = max(r["last"] for r in done) - begin
    ttft = np.array([r["first"] - r["sent"] for r in done]) * 1e3
    tpot = np.array([(r["last"] - r["first"]) / (r["chunks"] - 1) for r in done
                     if r["chunks"] > 1]) * 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2)  # noqa: E731
    return {
        "rate_requests_per_s": rate, "requests": len(prompts), "completed": len(done),
        "requests_per_s": round(len(done) / wall, 3),
        "output_chunks_per_s": round(sum(r["chunks"] for r in done) / wall, 1),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
    }


async def measure(system: str, args, prompts, lengths) -> dict:
    from openai import AsyncOpenAI

    port = free_port()
    command = server_command(system, args.model, port, args.engine_option)
    log = open(args.results_dir / f"serve-{system}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  [str(ROOT), os.environ.get("PYTHONPATH", "")])),
                              start_new_session=True)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=args.request_timeout, max_retries=0)
    started = time.perf_counter()
    try:
        await wait_ready(client, args.model, time.monotonic() + args.start_timeout)
        ready = time.perf_counter() - started
        print(f"serving {system}: ready in {ready:.1f} s", flush=True)
        rates = []
        for rate in args.rates:
            figures = await run_rate(client, args.model, prompts, lengths, rate, seed=int(rate))
            print(f"serving {system} at {rate} req/s: {figures}", flush=True)
            rates.append(figures)
        return {"command": command[3:] if system == "transformers" else command[1:],
                "ready_s": round(ready, 1), "rates": rates}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--num-requests", type=int, default=32, help="W1's first N")
    parser.add_argument("--max-input-len", type=int, default=1024, help="W1's: 1024")
    parser.add_argument("--max-output-len", type=int, default=1024, help="W1's: 1024")
    parser.add_argument("--systems", nargs="+", default=["transformers", "hf_paged"])
    parser.add_argument("--engine-option", action="append", default=[],
                        help="KEY=VALUE for hf-paged serve's engine")
    parser.add_argument("--start-timeout", type=float, default=240)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
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
        "max_output_tokens": sum(lengths), "arrivals": "Poisson", "runs": {},
    }
    for system in args.systems:
        try:
            result["runs"][system] = asyncio.run(measure(system, args, prompts, lengths))
        except Exception as error:  # a server that fails is reported, the other still runs
            result["runs"][system] = {"error": f"{type(error).__name__}: {error}"}
            print(f"serving {system} failed: {result['runs'][system]['error']}", flush=True)
        write_result(path, result)  # after each system: a run cut short keeps what it had
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
