"""LoRA serving (W9): W1 on the base model and with requests spread over several distinct
adapters, served unmerged in the same batches, in one run.

    python -m benchmarks.bench_lora --model /tmp/ckpt/0.6b --tag 0.6b

Made first: ``max(--adapters)`` distinct random adapters of rank ``--rank`` on all seven
projections, saved by peft (``benchmarks.lora_adapters``; each changes a projection's
output by about 3%) into ``--adapters-dir`` (default: a temporary folder). Then:

- ``w1``: W1 (``--num-requests`` etc., W1's defaults) at temperature 0.6 on the base model,
  then with 1, 4 and 16 adapters (``--adapters``), request ``i`` on adapter ``i mod N``, each
  against the base's throughput (the target: at least 85% of it with 16 adapters) and against
  its floor (``benchmarks.floor``: the weights a step, plus each distinct adapter among the
  requests still generating, once a step); transformers + peft ``generate`` on adapter 0 over
  the first ``--baseline-requests`` requests in left-padded batches of ``--batch-size``, and
  hf_paged with one adapter on those same requests beside it.
- ``batch1``: W2's decode request (batch 1, ``--prompt-len``, ``--new-tokens``) without and
  with adapter 0, each against its floor; transformers + peft at batch 1 on adapter 0
  (``--baseline-new-tokens`` new tokens: stock decoding is slow).

Every hf_paged line runs with ``max_loras`` the largest count and ``max_lora_rank`` the
adapters' rank (the stacks' rank: a larger one would read zero padding), unless ``-E`` says
otherwise. Time on an H100, estimated from W1's and W8's figures at the 0.6B shape: five W1
lines of 10-25 s start-up and 7-10 s each, the batch-1 lines about 40 s, the baselines about a
minute (peft's layers slow stock decoding further): 4 to 5 minutes. Writes
``lora-<tag>-<device>.json``.
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from typing import Any

import peft
import torch

from benchmarks import bench_latency, bench_throughput, common
from benchmarks.floor import LORA_FLOOR_MODEL, AdapterCost, MemoryCost, floor_settings
from benchmarks.lora_adapters import (
    LoraPagedSystem,
    PeftGenerateSystem,
    adapter_bytes,
    make_adapters,
)
from benchmarks.summary import summary_row
from benchmarks.workloads import add_w1_and_batch1_args, w1, w2_decode

PARTS = ("w1", "batch1")
TARGET = 0.85  # W1 with 16 adapters over the base model's W1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, ("generate",))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 16],
                        help="W1 lines: requests spread over this many adapters")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters-dir", help="where the adapters are saved (default: a "
                                               "temporary folder)")
    add_w1_and_batch1_args(parser)
    parser.add_argument("--baseline-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if min(args.adapters) < 1:
        parser.error(f"--adapters takes counts of at least 1, got {args.adapters}")
    if args.adapters_dir is None:
        with tempfile.TemporaryDirectory(prefix="lora-adapters-") as folder:
            run(args, folder)
    else:
        run(args, args.adapters_dir)


def run(args: argparse.Namespace, folder: str) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    adapters = make_adapters(args.model, folder, max(args.adapters), args.rank, dtype=dtype,
                             device=device)
    top = common.max_token_id(args.model)
    workload = w1(args.num_requests, args.max_input_len, args.max_output_len, top)
    few = workload.head(args.baseline_requests)
    decode = w2_decode(args.repeats, args.prompt_len, args.new_tokens, top)
    base = MemoryCost.from_checkpoint(args.model, dtype)
    one_adapter = adapter_bytes(adapters[0], dtype)
    cost = {n: AdapterCost(base, one_adapter, n) for n in {0, 1, *args.adapters}}

    options = {"max_loras": max(args.adapters), "max_lora_rank": args.rank,
               **common.engine_options(args.engine_option)}
    result = common.ResultFile("lora", args, device, summary)
    # the devices one engine runs on (tensor parallelism with adapters is refused), and peft's
    # version beside the others
    result["device"].update(count=options.get("tensor_parallel_size", 1),
                            peft=peft.__version__)
    result["workload_description"] = {
        "description": "W9: LoRA adapters served unmerged, W1 and batch 1 against the base",
        "parts": args.parts, "w1": workload.describe(), "temperature": args.temperature,
        "adapters": {"counts": args.adapters, "rank": args.rank, "projections": 7,
                     "bytes_each": one_adapter, "assignment": "request i on adapter i mod N"},
        "batch1": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "repeats": args.repeats, "baseline_new_tokens": args.baseline_new_tokens},
        "target_over_base": {"adapters": 16, "fraction": TARGET},
    }
    floor = floor_settings(device, args.bandwidth, base)
    floor["floor_model"] += " " + LORA_FLOOR_MODEL
    result["floor"] = {**floor, "adapter_bytes": one_adapter}
    with_baselines = bool(args.baselines) or args.reuse_baselines is not None
    result["baseline_requests"] = len(few.prompts) if with_baselines else None
    common.reuse_baselines(result, args)
    bandwidth = floor["bandwidth_bytes_per_s"]
    sampling = {"temperature": args.temperature}

    def paged(n: int, **more: Any) -> partial:
        return partial(LoraPagedSystem, args.model, dtype, device, adapters[:n], **options,
                       **more)

    def line(label: str, measure) -> dict:
        print(f"lora {label}", flush=True)
        result["hf_paged"][label] = common.guarded(label, measure)
        result.save()
        return result["hf_paged"][label]

    if "w1" in args.parts:
        for n in (0, *args.adapters):
            line(f"w1_{n}", partial(bench_throughput.measure, paged(n, sampling=sampling),
                                    workload, args.batch_size, cost[n], bandwidth, device))
        if with_baselines:
            line("w1_1@baseline_requests", partial(
                bench_throughput.measure, paged(1, sampling=sampling), few, args.batch_size,
                cost[1], bandwidth, device))
    if "batch1" in args.parts:
        for n in (0, 1):
            figures = line(f"batch1_{n}", partial(bench_latency.measure, paged(n), decode,
                                                  None, device))
            if "decode_ms_per_token" in figures:
                floor_s = cost[n].floor_bytes(decode.head(1)) / bandwidth
                figures["floor_ms_per_token"] = floor_s * 1e3 / args.new_tokens
    if args.baselines and args.reuse_baselines is None:
        stock = partial(PeftGenerateSystem, args.model, dtype, device, adapters[0])
        measured: dict[str, Any] = {}
        if "w1" in args.parts:
            measured["w1"] = common.guarded("transformers + peft W1", partial(
                bench_throughput.measure,
                partial(stock, batch_size=args.batch_size, temperature=args.temperature),
                few, args.batch_size, cost[1], bandwidth, device))
        if "batch1" in args.parts:
            short = w2_decode(args.repeats, args.prompt_len, args.baseline_new_tokens, top)
            measured["batch1"] = common.guarded("transformers + peft batch 1", partial(
                bench_latency.measure, partial(stock, batch_size=1), short, None, device))
        result["baselines"]["transformers_generate"] = common.parts_baseline(
            measured, ("output_tokens_per_s", "decode_ms_per_token"),
            baseline_path="transformers + peft, adapter unmerged")
    common.finish(result)


def adapters_label(n: int) -> str:
    return "base model" if n == 0 else f"{n} adapter{'s' * (n > 1)}"


def summary(data: dict) -> list[dict]:
    """W1 output tok/s of each line against its floor and, with adapters, its share of the
    base model's; batch-1 ms/token without and with an adapter; transformers + peft beside the
    one-adapter lines."""
    rows, paged = [], data["hf_paged"]
    lines = sorted((int(key.removeprefix("w1_")), fig) for key, fig in paged.items()
                   if key.startswith("w1_") and "@" not in key)
    base = paged.get("w1_0", {}).get("output_tokens_per_s")
    same = paged.get("w1_1@baseline_requests", {}).get("output_tokens_per_s")
    for n, fig in lines:
        if "output_tokens_per_s" not in fig:
            continue
        rows.append(summary_row(
            f"W1 output tok/s, {adapters_label(n)}", fig["output_tokens_per_s"],
            data["baselines"] if n == 1 else {}, "output_tokens_per_s",
            floor=fig["output_tokens"] / fig["floor_s"], higher_is_better=True,
            compare=same if n == 1 else None))
    for n, fig in lines:
        if n and base and "output_tokens_per_s" in fig:
            rows.append(summary_row(
                f"W1 tok/s with {adapters_label(n)} over the base model's",
                fig["output_tokens_per_s"] / base, {}, "", floor=None, higher_is_better=True))
    for n in (0, 1):
        if "decode_ms_per_token" in (fig := paged.get(f"batch1_{n}", {})):
            rows.append(summary_row(
                f"decode ms/token, batch 1, {adapters_label(n)}", fig["decode_ms_per_token"],
                data["baselines"] if n == 1 else {}, "decode_ms_per_token",
                floor=fig.get("floor_ms_per_token"), higher_is_better=False))
    return rows


if __name__ == "__main__":
    main()
