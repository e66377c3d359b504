"""Where W1's time goes: its steps timed one by one and grouped (prefill, then decode by batch
size), each group's seconds set against its own floor.

    python -m benchmarks.w1_split --model /tmp/ckpt/0.6b

A step's time is the wall time from one ``engine.step()`` return to the next, charged to the
batch that call launched (in steady state the period of that step); the profiled steps are a
group of their own. A decode step's floor is
the bytes it must read, the weights once and the KV cache of each sequence's context, over the
device's peak bandwidth (``benchmarks.floor``); prefill steps have no memory floor of their own
(W1's floor counts none of them), so their seconds are what prefill adds to it. Sampling at
Qwen3's settings (temperature 0.6, top-k 20, top-p 0.95), as the W1 line the targets name.
On a GPU, the kernels of a few decode steps at full batch (from step 100) are profiled too:
their time per step, by kernel. Writes ``<results>/w1-split-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import hf_paged
from benchmarks import common
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.profile_steps import add_kernel_times
from benchmarks.workloads import w1, warmup_requests
from hf_paged.sampling_params import SamplingParams

QWEN3_SAMPLING = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
# Decode steps grouped by their batch: a group's lower bound.
BATCH_GROUPS = (192, 128, 64, 16, 1)
PROFILED_STEPS = range(100, 108)


def group_of(batch) -> str:
    if not batch.is_decode:
        return "prefill"
    size = len(batch.seqs)
    return f"decode_{next(g for g in BATCH_GROUPS if size >= g)}+"


def split_run(engine, workload, cost: MemoryCost, bandwidth: float) -> dict:
    """Run ``workload`` stepping ``engine`` by hand; per group: steps, seconds, floor."""
    for prompt, n in zip(workload.prompts, workload.max_new_tokens):
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                  **QWEN3_SAMPLING))
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[str, float] = defaultdict(float)
    profiling = engine.device.type == "cuda"
    index = 0
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        profiled = profiling and index in PROFILED_STEPS
        if profiled:
            torch.cuda.synchronize()  # the step's kernels alone, not the previous one's
            add_kernel_times(engine.step, kernels)
        else:
            engine.step()
        index += 1
        now = time.perf_counter()
        launched = engine.in_flight[0] if engine.in_flight is not None else None
        if profiled:  # synchronised and profiled: its time is not a step period
            groups["profiled"]["steps"] += 1
            groups["profiled"]["seconds"] += now - last
        elif launched is not None:
            group = groups[group_of(launched)]
            group["steps"] += 1
            group["seconds"] += now - last
            group["tokens"] += sum(launched.num_tokens)
            if launched.is_decode:
                context = sum(s + n for s, n in zip(launched.starts, launched.num_tokens))
                group["floor_seconds"] += (
                    cost.weight_bytes(len(launched.seqs)) + context * cost.kv_bytes_per_token
                ) / bandwidth
        last = now
    total = time.perf_counter() - start
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    out = {"seconds": total, "profiled_steps": [PROFILED_STEPS.start, PROFILED_STEPS.stop],
           "profiled_kernel_ms_per_step": {k: v / len(PROFILED_STEPS) for k, v in top},
           "groups": {}}
    for name, g in sorted(groups.items()):
        g = dict(g)
        if "floor_seconds" in g:
            g["fraction_of_floor"] = g["floor_seconds"] / g["seconds"]
            g["ms_per_step"] = 1e3 * g["seconds"] / g["steps"]
        out["groups"][name] = g
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--name", default="w1-split")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--engine-option", "-E", action="append", default=[],
                        metavar="NAME=VALUE", help="an EngineConfig setting (repeatable)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cost = MemoryCost.from_checkpoint(args.model, dtype)
    bandwidth = floor_settings(device, None, cost)["bandwidth_bytes_per_s"]
    workload = w1(args.num_requests, args.max_input_len, args.max_output_len,
                  common.max_token_id(args.model))
    options = common.engine_options(args.engine_option)
    engine = hf_paged.from_pretrained(args.model, dtype=dtype, device=device,
                                      progress_bar=False, **options)
    try:
        warm = warmup_requests(workload.head(8))  # other prompts: no prefix-cache hits
        engine.generate_tokens(warm.prompts, SamplingParams(max_new_tokens=16))
        run = split_run(engine, workload, cost, bandwidth)
    finally:
        engine.close()
    result = {"workload": "w1-split", "device": common.device_info(device),
              "git_commit": common.git_commit(), "checkpoint": args.model,
              "sampling": QWEN3_SAMPLING, "engine_options": options,
              "bandwidth_bytes_per_s": bandwidth,
              "output_tokens": sum(workload.max_new_tokens),
              "output_tokens_per_s": sum(workload.max_new_tokens) / run["seconds"], **run}
    common.write_result(args.results_dir / f"{args.name}-{result['device']['slug']}.json",
                        result)
    print(json.dumps(result["groups"], indent=1), f"\n{result['output_tokens_per_s']:,.0f} tok/s")


if __name__ == "__main__":
    main()
