"""Quantized serving (W8): hf_paged on a fine-grained FP8 checkpoint against its bf16 original,
and the FP8 KV cache against the bf16 one, in the same run.

    python -m benchmarks.bench_quantized --model /tmp/ckpt/0.6b --fp8-model /tmp/ckpt/0.6b-fp8
    python -m benchmarks.bench_quantized --model /tmp/ckpt/8b --fp8-model /tmp/ckpt/8b-fp8 \
        --parts w1 batch1 --tag 8b

Parts (``--parts``, default all):

- ``w1``: W1 (``--num-requests`` etc., W1's defaults) at temperature 0.6 on the bf16 and on
  the FP8 checkpoint, each against its own floor (``benchmarks.floor``: float8 weights a byte,
  their scale grids four); transformers' ``generate`` on the FP8 checkpoint over the first
  ``--baseline-requests`` requests in left-padded batches of ``--batch-size``, hf_paged on those
  same requests beside it.
- ``batch1``: W2's decode request (batch 1, ``--prompt-len``, ``--new-tokens``) on both
  checkpoints, each against its floor; transformers' ``generate`` on the FP8 checkpoint at
  batch 1 (``--baseline-new-tokens`` new tokens: stock decoding is slow).
- ``kv``: W1 on the bf16 checkpoint with ``kv_cache_dtype="fp8"`` against the bf16 cache (the
  ``w1`` part's bf16 line when it ran), each against its floor (the KV cache in its own
  dtype); and how the caches agree: greedy decoding with the bf16 cache over
  ``--agreement-prompts`` W1 prompts, ``--agreement-tokens`` tokens each, then the FP8 cache
  forced onto the same tokens; per token, the KL divergence of the FP8 cache's next-token
  distribution from the bf16 cache's, and whether their top-1 tokens agree.

transformers' baseline is its own FP8 path (``from_pretrained(..., device_map=...)``: its
Triton FP8 kernels on CUDA). Those kernels come from the Hub through the ``kernels`` package;
on a machine without it, ``--stock-fp8-kernel PATH`` hands transformers a local copy of that
package (``benchmarks/stock_fp8_kernel.py``). Where the FP8 path still cannot run, the error is
recorded under ``transformers_fp8_kernels`` and the
baseline is transformers dequantizing the checkpoint on load (``FineGrainedFP8Config(
dequantize=True)``), named so in ``baseline_path``.

Time on an H100, estimated from the figures of W1, W2 and W4 (a reduced run of every part on
the 0.6B shape, 32 requests, took 110 s with its baselines): the 0.6B shape about 3 minutes
for all parts (each hf_paged line is an engine start, 10-25 s, and its run; the baselines
about a minute), the 8B ``w1 batch1`` about 3, the 30B-A3B with 24 layers about 4. Writes
``quantized-<tag>-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import FineGrainedFP8Config, LogitsProcessor

import hf_paged
from benchmarks import bench_latency, bench_throughput, common, stock_fp8_kernel
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.summary import summary_row
from benchmarks.systems import GenerateSystem, PagedSystem, free_memory
from benchmarks.workloads import add_w1_and_batch1_args, w1, w2_decode, w2_ttft

PARTS = ("w1", "batch1", "kv")
KV_FP8 = {"kv_cache_dtype": "fp8"}


class ForceTokens(LogitsProcessor):
    """Teacher forcing in ``generate``: row ``r``'s ``s``-th new token is ``tokens[r, s]``
    (the raw logits, which ``output_logits`` returns, are left as computed)."""

    def __init__(self, tokens: torch.Tensor, prompt_width: int):
        self.tokens, self.width = tokens, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = self.tokens[:, input_ids.shape[1] - self.width].to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, forced[:, None], 0.0)


def cache_agreement(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Per-token agreement of two runs' next-token logits ``[tokens, vocab]``: the KL
    divergence of ``other``'s softmax from ``reference``'s (mean, 99th percentile, max) and
    the share of tokens whose top-1 agrees."""
    ref = reference.float().log_softmax(-1)
    kl = (ref.exp() * (ref - other.float().log_softmax(-1))).sum(-1)
    return {"tokens": kl.numel(), "kl_mean": kl.mean().item(),
            "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
            "top1_agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item()}


def agreement(path: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
              new_tokens: int, options: dict) -> dict[str, float]:
    """``cache_agreement`` of the FP8 KV cache with the bf16 one on ``prompts`` (left-padded,
    one batch): the bf16 cache's greedy tokens, then the FP8 cache forced onto them."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    logits, forced = [], None  # the second run forced onto the first one's tokens
    for extra in ({}, KV_FP8):
        engine = hf_paged.from_pretrained(path, dtype=dtype, device=device, **options, **extra)
        try:
            out = engine.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0,
                                  return_dict_in_generate=True, output_logits=True,
                                  logits_processor=forced)
            logits.append(torch.stack(out.logits, 1).float().cpu().flatten(0, 1))
            forced = [ForceTokens(out.sequences[:, width:].cpu(), width)]
        finally:
            engine.close()
            del engine
            free_memory()
    return cache_agreement(*logits)


def transformers_fp8(path: str, dtype: torch.dtype, device: torch.device, measure,
                     result: common.ResultFile, **system: Any) -> dict:
    """``measure(build)`` of transformers' generate on the FP8 checkpoint: its FP8 path, or
    where that fails its dequantized path (the failure kept in the result)."""
    fp8 = partial(GenerateSystem, path, dtype, device, load={"device_map": str(device)},
                  **system)
    figures = common.guarded("transformers FP8 path", lambda: measure(fp8))
    if "error" not in figures:  # on a CPU transformers dequantizes on load by itself
        return {"baseline_path": "fp8 kernels" if device.type == "cuda" else
                "dequantized on load (CPU)", **figures}
    result["transformers_fp8_kernels"] = figures["error"]
    keep = json.loads((Path(path) / "config.json").read_text())["quantization_config"].get(
        "modules_to_not_convert")
    config = FineGrainedFP8Config(dequantize=True, modules_to_not_convert=keep)
    dequantized = partial(GenerateSystem, path, dtype, device,
                          load={"quantization_config": config}, **system)
    return {"baseline_path": "dequantized on load",
            **common.guarded("transformers dequantized", lambda: measure(dequantized))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, ("generate",))
    parser.add_argument("--fp8-model", help="the FP8 copy of --model (parts w1 and batch1)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    add_w1_and_batch1_args(parser)
    parser.add_argument("--ttft-prompt-len", type=int, default=1024)
    parser.add_argument("--baseline-new-tokens", type=int, default=64)
    parser.add_argument("--baseline-max-output-len", type=int,
                        help="W1's baseline requests (and hf_paged's line on them) generate at "
                        "most this many tokens each: stock FP8 MoE generate is slow")
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--agreement-tokens", type=int, default=128)
    parser.add_argument("--stock-fp8-kernel", metavar="PATH",
                        help="a local copy of the hub package kernels-community/finegrained-fp8 "
                             "(its finegrained_fp8 folder), where transformers' FP8 path cannot "
                             "download it (benchmarks/stock_fp8_kernel.py)")
    args = parser.parse_args(argv)
    if {"w1", "batch1"} & set(args.parts) and not args.fp8_model:
        parser.error("--fp8-model is needed for the w1 and batch1 parts")

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    stock_fp8_kernel.register(args.stock_fp8_kernel)
    top = common.max_token_id(args.model)
    workload = w1(args.num_requests, args.max_input_len, args.max_output_len, top)
    few = workload.head(args.baseline_requests).capped(args.baseline_max_output_len)
    costs = {"bf16": MemoryCost.from_checkpoint(args.model, dtype)}
    if args.fp8_model:
        costs["fp8_weights"] = MemoryCost.from_checkpoint(args.fp8_model, dtype)
    if "kv" in args.parts:
        costs["fp8_kv"] = MemoryCost.from_checkpoint(args.model, dtype, "fp8")
    result = common.ResultFile("quantized", args, device, summary)
    result["checkpoint"]["fp8_path"] = args.fp8_model
    result["workload_description"] = {
        "description": "W8: FP8 weights and the FP8 KV cache against bf16, in one run",
        "parts": args.parts, "w1": workload.describe(), "temperature": args.temperature,
        "batch1": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "repeats": args.repeats, "baseline_new_tokens": args.baseline_new_tokens},
        "kv_agreement": {"prompts": args.agreement_prompts, "tokens": args.agreement_tokens},
        "baseline_max_output_len": args.baseline_max_output_len,
    }
    result["floor"] = {name: floor_settings(device, args.bandwidth, cost)
                       for name, cost in costs.items()}
    with_baselines = bool(args.baselines) or args.reuse_baselines is not None
    result["baseline_requests"] = len(few.prompts) if with_baselines else None
    common.reuse_baselines(result, args)
    bandwidth = result["floor"]["bf16"]["bandwidth_bytes_per_s"]
    options = common.engine_options(args.engine_option)
    sampling = {"temperature": args.temperature}
    path_of = {"bf16": args.model, "fp8_weights": args.fp8_model, "fp8_kv": args.model}
    extra_of = {"bf16": {}, "fp8_weights": {}, "fp8_kv": KV_FP8}

    def paged(line: str, **more: Any) -> partial:
        return partial(PagedSystem, path_of[line], dtype, device, **options, **extra_of[line],
                       **more)

    def run(label: str, measure) -> dict:
        print(f"quantized {label}", flush=True)
        result["hf_paged"][label] = common.guarded(label, measure)
        result.save()
        return result["hf_paged"][label]

    w1_lines = [line for part, line in (("w1", "bf16"), ("w1", "fp8_weights"), ("kv", "bf16"),
                                        ("kv", "fp8_kv")) if part in args.parts]
    for line in dict.fromkeys(w1_lines):
        run(f"w1_{line}", partial(bench_throughput.measure, paged(line, sampling=sampling),
                                  workload, args.batch_size, costs[line], bandwidth, device))
    if "kv" in args.parts:
        prompts = workload.head(args.agreement_prompts).prompts
        result["kv_cache_agreement"] = common.guarded("kv agreement", partial(
            agreement, args.model, dtype, device, prompts, args.agreement_tokens, options))
        result.save()
    decode = w2_decode(args.repeats, args.prompt_len, args.new_tokens, top)
    if "batch1" in args.parts:
        ttft = w2_ttft(args.repeats, args.ttft_prompt_len, top)
        for line in ("bf16", "fp8_weights"):
            figures = run(f"batch1_{line}", partial(bench_latency.measure, paged(line),
                                                    decode, ttft, device))
            if "decode_ms_per_token" in figures:
                floor = costs[line].floor_bytes(decode.head(1)) / bandwidth
                figures["floor_ms_per_token"] = floor * 1e3 / args.new_tokens
    if "w1" in args.parts and with_baselines:
        run("w1_fp8_weights@baseline_requests", partial(
            bench_throughput.measure, paged("fp8_weights", sampling=sampling), few,
            args.batch_size, costs["fp8_weights"], bandwidth, device))
    if args.baselines and args.fp8_model and args.reuse_baselines is None:
        measured: dict[str, Any] = {}
        if "w1" in args.parts:
            measured["w1"] = transformers_fp8(
                args.fp8_model, dtype, device, lambda build: bench_throughput.measure(
                    build, few, args.batch_size, costs["fp8_weights"], bandwidth, device),
                result, batch_size=args.batch_size, temperature=args.temperature)
        if "batch1" in args.parts:
            short = w2_decode(args.repeats, args.prompt_len, args.baseline_new_tokens, top)
            measured["batch1"] = transformers_fp8(
                args.fp8_model, dtype, device,
                lambda build: bench_latency.measure(build, short, None, device), result,
                batch_size=1)
        result["baselines"]["transformers_generate"] = common.parts_baseline(
            measured, ("output_tokens_per_s", "decode_ms_per_token"))
    common.finish(result)


def summary(data: dict) -> list[dict]:
    """Output tok/s of each W1 line and batch-1 ms/token of each checkpoint against its floor;
    transformers' FP8 generate beside the FP8 lines."""
    rows, paged = [], data["hf_paged"]
    names = {"bf16": "bf16", "fp8_weights": "FP8 weights", "fp8_kv": "FP8 KV cache"}
    same = paged.get("w1_fp8_weights@baseline_requests", {})
    for line, name in names.items():
        if "output_tokens_per_s" in (fig := paged.get(f"w1_{line}", {})):
            rows.append(summary_row(
                f"W1 output tok/s, {name}", fig["output_tokens_per_s"],
                data["baselines"] if line == "fp8_weights" else {}, "output_tokens_per_s",
                floor=fig["output_tokens"] / fig["floor_s"], higher_is_better=True,
                compare=same.get("output_tokens_per_s") if line == "fp8_weights" else None))
    for line in ("bf16", "fp8_weights"):
        if "decode_ms_per_token" in (fig := paged.get(f"batch1_{line}", {})):
            rows.append(summary_row(
                f"decode ms/token, batch 1, {names[line]}", fig["decode_ms_per_token"],
                data["baselines"] if line == "fp8_weights" else {}, "decode_ms_per_token",
                floor=fig.get("floor_ms_per_token"), higher_is_better=False))
    return rows


if __name__ == "__main__":
    main()
