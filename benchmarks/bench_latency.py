"""Batch-1 latency (W2): milliseconds per output token, and time to first token.

    python -m benchmarks.bench_latency --model /tmp/ckpt/0.6b
    python -m benchmarks.bench_latency --model /tmp/ckpt/8b --workload w4 \
        --tensor-parallel-size 1 2 --baselines

``--workload w4`` (W4's batch-1 lines) runs hf_paged once per ``--tensor-parallel-size``,
labelled ``tensor_parallel_size_N``, into ``w4-batch1-<device>.json``.

ms per output token = wall time of one request (128-token prompt, 256 new tokens) / 256, its
prefill included. Time to first token = wall time of one request with a 1,024-token prompt and
one new token; ``streamed_ttft_ms``: from a ``generate`` call with a streamer to the streamer's
first new token, on other prompts of that length. Each is the median over ``--repeats``
requests, each with a prompt of its own (so that no prefix cache serves a repeat), after a
warm-up request of each size. The static
cache baseline is measured on decode only: its first token is stock generate's eager prefill.
The floor of a decode token is ``FLOOR_MODEL`` of ``benchmarks.floor`` for one request: the
weights (of a mixture of experts, the k experts a token routes to in each sparse layer) and
the request's short KV cache, read once per token.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch

from benchmarks import common
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.summary import summary_row
from benchmarks.systems import GenerateSystem, PagedSystem, System
from benchmarks.workloads import Workload, w2_decode, w2_ttft, warmup_requests

BASELINES = ("generate", "static")


def median_ms(system: System, workload: Workload, device: torch.device) -> tuple[float, list]:
    """The median wall time in ms of each request of ``workload`` run alone, and the samples."""
    samples = [common.timed(lambda r=r: system.run(r), device)[1] for r in workload.requests()]
    return statistics.median(samples) * 1e3, samples


def measure(
    build: Callable[[], System], decode: Workload, ttft: Workload | None, device: torch.device
) -> dict:
    """Build, warm up with one request of each size on other prompts, then time each request
    of ``decode`` (and of ``ttft``) on its own."""
    system, startup_s = common.timed(build, device)
    try:
        sizes = {"decode": decode} if ttft is None else {"decode": decode, "ttft": ttft}
        # The warm-up requests (fresh prompts, the measured lengths) are the first of their
        # prompt length: anything compiled or allocated on first use shows as their time over
        # the steady one.
        first = {
            name: common.timed(
                lambda w=w: system.run(warmup_requests(w.head(1), w.max_new_tokens[0])), device
            )[1]
            for name, w in sizes.items()
        }
        decode_ms, decode_samples = median_ms(system, decode, device)
        figures = {
            "decode_ms_per_token": decode_ms / decode.max_new_tokens[0],
            "decode_samples_s": decode_samples,
            "startup_s": startup_s,
            "first_decode_request_ms": first["decode"] * 1e3,
            "first_over_steady_decode": first["decode"] * 1e3 / decode_ms,
        }
        if ttft is not None:
            figures["ttft_ms"], figures["ttft_samples_s"] = median_ms(system, ttft, device)
            # generate()'s first call: its settings resolution warms up too.
            system.first_streamed_token_s(warmup_requests(ttft.head(1), seed=3).prompts[0])
            streamed = [system.first_streamed_token_s(p)
                        for p in warmup_requests(ttft, seed=2).prompts]
            figures["streamed_ttft_ms"] = statistics.median(streamed) * 1e3
            figures["streamed_ttft_samples_s"] = streamed
            figures["first_ttft_request_ms"] = first["ttft"] * 1e3
            figures["first_over_steady_ttft"] = first["ttft"] * 1e3 / figures["ttft_ms"]
        figures.update(system.describe())
        print(  # before closing: a close that hangs leaves the figures in the log
            "  " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()
                             if k.endswith(("ms", "token"))), flush=True
        )
    finally:
        system.close()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, BASELINES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt of the decode request")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ttft-prompt-len", type=int, default=1024)
    parser.add_argument("--workload", choices=["w2", "w4"], default="w2")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                        help="one hf_paged run per size; sizes above the GPU count are skipped")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    top = common.max_token_id(args.model)
    decode = w2_decode(args.repeats, args.prompt_len, args.new_tokens, top)
    ttft = w2_ttft(args.repeats, args.ttft_prompt_len, top)
    options = common.engine_options(args.engine_option)
    cost = MemoryCost.from_checkpoint(args.model, dtype, options.get("kv_cache_dtype", "auto"))
    floor = floor_settings(device, args.bandwidth, cost)
    bandwidth = floor["bandwidth_bytes_per_s"]
    floor_ms = cost.floor_bytes(decode.head(1)) / bandwidth * 1e3 / args.new_tokens
    sizes = args.tensor_parallel_size
    if device.type == "cuda":
        sizes = [n for n in sizes if n <= torch.cuda.device_count()]
    by_size = args.workload == "w4"
    result = common.ResultFile(
        "w4-batch1" if by_size else "w2",
        args,
        device,
        partial(summary, floor_ms=floor_ms, ttft_prompt_len=args.ttft_prompt_len),
    )
    result["workload_description"] = {
        "description": "W2 latency: batch 1; decode ms per output token and time to first token",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "ttft_prompt_len": args.ttft_prompt_len,
        "repeats": args.repeats,
    }
    result["floor"] = floor
    common.reuse_baselines(result, args)

    if skipped := sorted(set(args.tensor_parallel_size) - set(sizes)):
        result["skipped"] = {f"tensor_parallel_size_{n}": "more ranks than GPUs" for n in skipped}
    for n in sizes:
        label = f"tensor_parallel_size_{n}" if by_size else "hf_paged"
        print(f"{result['workload']} {label}")
        paged = partial(PagedSystem, args.model, dtype, device, tensor_parallel_size=n,
                        **options)
        result["hf_paged"][label] = measure(paged, decode, ttft, device)
        result.save()

    generate = partial(GenerateSystem, args.model, dtype, device, batch_size=1)
    static = partial(generate, static=True, max_cache_len=args.prompt_len + args.new_tokens)
    common.run_baselines(
        result,
        args,
        {
            "generate": partial(measure, generate, decode, ttft, device),
            "static": partial(measure, static, decode, None, device),  # its prefill is generate's
        },
    )
    common.finish(result)


def summary(data: dict, floor_ms: float, ttft_prompt_len: int) -> list[dict]:
    """Two lines per hf_paged run (the baselines on the first run's lines); a size-N run's
    floor reads each rank's 1/N of the weights at every GPU's bandwidth at once."""
    rows = []
    for i, (label, mine) in enumerate(data["hf_paged"].items()):
        baselines = data["baselines"] if i == 0 else {}
        ranks = mine["engine_config"]["tensor_parallel_size"]
        suffix = "" if label == "hf_paged" else f", {label.replace('_', ' ')}"
        rows += [
            summary_row(
                "decode ms/token, batch 1" + suffix,
                mine["decode_ms_per_token"],
                baselines,
                "decode_ms_per_token",
                floor=floor_ms / ranks,
                higher_is_better=False,
            ),
            summary_row(
                f"time to first token ms, {ttft_prompt_len}-token prompt" + suffix,
                mine["ttft_ms"],
                baselines,
                "ttft_ms",
                floor=None,
                higher_is_better=False,
            ),
            summary_row(
                f"time to first streamed token ms, {ttft_prompt_len}-token prompt" + suffix,
                mine["streamed_ttft_ms"],
                baselines,
                "streamed_ttft_ms",
                floor=None,
                higher_is_better=False,
            ),
        ]
    return rows


if __name__ == "__main__":
    main()
