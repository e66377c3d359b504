"""Hybrid models (Gated DeltaNet layers beside full attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next):
W1, batch-1 decode and the shared-prefix workload W3 on one checkpoint, in one run.

    python -m benchmarks.make_checkpoint --shape qwen3.5-9b --out /tmp/ckpt/qwen3.5-9b
    python -m benchmarks.bench_hybrid --model /tmp/ckpt/qwen3.5-9b --tag qwen3.5-9b

Parts (``--parts``, default all):

- ``w1``: W1 (``--num-requests`` etc., W1's defaults) at temperature 0.6 against its floor
  (``benchmarks.floor``: the weights, the full-attention layers' KV, and each generating
  sequence's linear-layer state read and written a step); transformers' ``generate`` over the
  first ``--baseline-requests`` requests, their outputs cut to ``--baseline-max-output``
  tokens (stock decoding of a hybrid model is slow), in left-padded batches of
  ``--batch-size``, with hf_paged on those same requests beside it.
- ``batch1``: W2's decode request (batch 1, ``--prompt-len``, ``--new-tokens``) and its time
  to first token, against the floor; transformers' ``generate`` at batch 1 with
  ``--baseline-new-tokens`` new tokens.
- ``w3``: W3 (``--w3-requests`` requests sharing a ``--w3-prefix-len``-token prefix,
  ``--w3-new-tokens`` each, greedy) with prefix caching on and ``num_state_snapshots=
  --snapshots`` (a hybrid model's prefix cache hits only where a snapshot of the linear
  layers' state sits), then with prefix caching off; their ratio is ``prefix_caching_speedup``.

The stock model loads straight onto the device (``device_map``); its linear layers run
flash-linear-attention's and causal-conv1d's kernels where those are installed, else
transformers' torch fallbacks (``linear_attention_path`` in its result says which). Writes
``hybrid-<tag>-<device>.json``; the time on an H100 is in ``scripts/gpu_run.sh``'s header.
"""

from __future__ import annotations

import argparse
import importlib.util
from functools import partial
from typing import Any

import torch

from benchmarks import bench_latency, bench_throughput, common
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.summary import summary_row
from benchmarks.systems import GenerateSystem, PagedSystem
from benchmarks.workloads import Workload, add_w1_and_batch1_args, w1, w2_decode, w2_ttft, w3

PARTS = ("w1", "batch1", "w3")
W3_LINES = ("w3_prefix_caching_on", "w3_prefix_caching_off")


def cut(workload: Workload, max_new_tokens: int) -> Workload:
    """``workload`` with every request's output cut to at most ``max_new_tokens``."""
    return Workload(workload.prompts, [min(n, max_new_tokens) for n in workload.max_new_tokens])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, ("generate",))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    add_w1_and_batch1_args(parser)
    parser.add_argument("--baseline-max-output", type=int, default=128)
    parser.add_argument("--ttft-prompt-len", type=int, default=1024)
    parser.add_argument("--baseline-new-tokens", type=int, default=64)
    parser.add_argument("--w3-requests", type=int, default=256)
    parser.add_argument("--w3-prefix-len", type=int, default=2048)
    parser.add_argument("--w3-new-tokens", type=int, default=128)
    parser.add_argument("--snapshots", type=int, default=64,
                        help="num_state_snapshots of W3's prefix-caching line")
    args = parser.parse_args(argv)
    if args.snapshots < 1:
        parser.error(f"--snapshots must be at least 1 (none: no prefix-cache hit), got "
                     f"{args.snapshots}")

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    top = common.max_token_id(args.model)
    options = common.engine_options(args.engine_option)
    cost = MemoryCost.from_checkpoint(args.model, dtype, options.get("kv_cache_dtype", "auto"))
    if not cost.state_bytes_per_seq:
        raise SystemExit(f"--model {args.model}: not a hybrid model (no linear-attention layer)")
    workload = w1(args.num_requests, args.max_input_len, args.max_output_len, top)
    few = cut(workload.head(args.baseline_requests), args.baseline_max_output)
    shared = w3(args.w3_requests, args.w3_prefix_len, 32, args.w3_new_tokens, top)
    result = common.ResultFile("hybrid", args, device, summary)
    result["workload_description"] = {
        "description": "hybrid models: W1, batch-1 decode and W3 with prefix caching on and off",
        "parts": args.parts, "w1": workload.describe(), "temperature": args.temperature,
        "w1_baseline_max_output": args.baseline_max_output,
        "batch1": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "ttft_prompt_len": args.ttft_prompt_len, "repeats": args.repeats,
                   "baseline_new_tokens": args.baseline_new_tokens},
        "w3": {"prefix_len": args.w3_prefix_len, "unique_len": 32, **shared.describe(),
               "num_state_snapshots": args.snapshots},
    }
    result["floor"] = floor_settings(device, args.bandwidth, cost)
    with_baselines = bool(args.baselines) or args.reuse_baselines is not None
    result["baseline_requests"] = len(few.prompts) if with_baselines else None
    common.reuse_baselines(result, args)
    bandwidth = result["floor"]["bandwidth_bytes_per_s"]
    paged = partial(PagedSystem, args.model, dtype, device, **options)

    def run(label: str, measure) -> dict:
        print(f"hybrid {label}", flush=True)
        result["hf_paged"][label] = common.guarded(label, measure)
        result.save()
        return result["hf_paged"][label]

    def throughput(requests: Workload, build) -> partial:
        return partial(bench_throughput.measure, build, requests, args.batch_size, cost,
                       bandwidth, device)

    sampling = {"temperature": args.temperature}
    if "w1" in args.parts:
        run("w1", throughput(workload, partial(paged, sampling=sampling)))
        if with_baselines:
            run(bench_throughput.SAME_REQUESTS, throughput(few, partial(paged, sampling=sampling)))
    decode = w2_decode(args.repeats, args.prompt_len, args.new_tokens, top)
    if "batch1" in args.parts:
        ttft = w2_ttft(args.repeats, args.ttft_prompt_len, top)
        figures = run("batch1", partial(bench_latency.measure, paged, decode, ttft, device))
        if "decode_ms_per_token" in figures:
            floor = cost.floor_bytes(decode.head(1)) / bandwidth
            figures["floor_ms_per_token"] = floor * 1e3 / args.new_tokens
    if "w3" in args.parts:
        greedy = {"temperature": 0.0}
        for label, extra in zip(W3_LINES, (
                {"enable_prefix_caching": True, "num_state_snapshots": args.snapshots},
                {"enable_prefix_caching": False})):
            run(label, throughput(shared, partial(paged, sampling=greedy, **extra)))
        on, off = (result["hf_paged"][label].get("output_tokens_per_s") for label in W3_LINES)
        if on and off:
            result["prefix_caching_speedup"] = on / off
    if args.baselines and args.reuse_baselines is None:
        stock = partial(GenerateSystem, args.model, dtype, device,
                        load={"device_map": str(device)} if device.type == "cuda" else None)
        measured: dict[str, Any] = {}
        if "w1" in args.parts:
            measured["w1"] = common.guarded("transformers generate, w1", partial(
                bench_throughput.measure, partial(stock, args.batch_size,
                                                  temperature=args.temperature),
                few, args.batch_size, cost, bandwidth, device))
        if "batch1" in args.parts:
            short = w2_decode(args.repeats, args.prompt_len, args.baseline_new_tokens, top)
            measured["batch1"] = common.guarded("transformers generate, batch1", partial(
                bench_latency.measure, partial(stock, 1), short, None, device))
        kernels = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name)]
        result["baselines"]["transformers_generate"] = common.parts_baseline(
            measured, ("output_tokens_per_s", "decode_ms_per_token"),
            linear_attention_path=", ".join(kernels) or "transformers' torch fallbacks")
    common.finish(result)


def summary(data: dict) -> list[dict]:
    """W1 output tok/s and batch-1 ms/token against their floors and stock generate; W3's
    output tok/s with prefix caching on and off, against their floors."""
    rows, paged = [], data["hf_paged"]
    same = paged.get(bench_throughput.SAME_REQUESTS, {})
    if "output_tokens_per_s" in (fig := paged.get("w1", {})):
        rows.append(summary_row(
            "W1 output tok/s", fig["output_tokens_per_s"], data["baselines"],
            "output_tokens_per_s", floor=fig["output_tokens"] / fig["floor_s"],
            higher_is_better=True, compare=same.get("output_tokens_per_s")))
    if "decode_ms_per_token" in (fig := paged.get("batch1", {})):
        rows.append(summary_row(
            "decode ms/token, batch 1", fig["decode_ms_per_token"], data["baselines"],
            "decode_ms_per_token", floor=fig.get("floor_ms_per_token"), higher_is_better=False))
    for label in W3_LINES:
        if "output_tokens_per_s" in (fig := paged.get(label, {})):
            rows.append(summary_row(
                f"W3 output tok/s, {label[3:].replace('_', ' ')}", fig["output_tokens_per_s"],
                {}, "output_tokens_per_s", floor=fig["output_tokens"] / fig["floor_s"],
                higher_is_better=True))
    return rows


if __name__ == "__main__":
    main()
