"""Offline throughput: output tokens per second of hf_paged and of transformers' baselines.

    python -m benchmarks.bench_throughput --model /tmp/ckpt/0.6b                  # W1
    python -m benchmarks.bench_throughput --model /tmp/ckpt/0.6b --workload w3 --baselines
    python -m benchmarks.bench_throughput --model /tmp/ckpt/8b --workload w4 --baselines  # W4

W1 is nano-vllm's bench (256 requests, 133,966 output tokens); W3 is 256 requests sharing one
2,048-token prefix, measured with hf_paged's prefix caching on and then off. W4 is W1 on the
8B shape with tensor_parallel_size 1, 2 and 4 (``--tensor-parallel-size`` chooses; sizes
above the visible GPU count are skipped): a size-N run's floor reads each rank's 1/N of the
weights and KV cache at every GPU's bandwidth at once. ``--data-parallel-size 1 2 4`` runs
the workload once per number of replicas (``data_parallel_size``), with each size's scaling
over the size-1 run in the result (``data_parallel_scaling``); its floor is the slowest
replica's, the requests dealt to replicas as the engine deals them (heaviest first, to the
least loaded), each replica reading its own weights. The one workload shared out over more
replicas gives each a smaller batch, whose floor falls less than the replica count (W1: 1.81x
at two replicas, 3.17x at four); ``--weak-scaling`` gives N replicas a workload of N times the
requests instead (drawn as the workload draws them), a whole one's load for each. Each hf_paged run
builds a fresh engine (start-up timed), warms it up on other prompts, and times one
``generate_tokens`` call over the whole workload.

The baselines are slow, so they run on the workload's first ``--baseline-requests`` requests,
and hf_paged runs on those same requests too (``hf_paged@baseline_requests``): the speedups
compare like with like. ``--reuse-baselines FILE`` takes the baseline figures of an earlier run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from benchmarks import common
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.summary import summary_row
from benchmarks.systems import ContinuousBatchingSystem, GenerateSystem, PagedSystem, System
from benchmarks.workloads import Workload, w1, w3, warmup_requests

BASELINES = ("generate", "static", "cb")
SAME_REQUESTS = "hf_paged@baseline_requests"  # hf_paged on the requests the baselines ran

# The hf_paged lines beside W1's main one when it samples at a temperature: greedy, and the
# settings every Qwen3 checkpoint ships in generation_config.json.
EXTRA_LINES = {
    "greedy": {"sampling": {"temperature": 0.0}},
    "qwen3_sampling": {"sampling": {"temperature": 0.6, "top_k": 20, "top_p": 0.95}},
}


def build_workload(args: argparse.Namespace, max_token_id: int) -> tuple[Workload, dict]:
    w3_shaped = args.workload == "w3"
    sizes = {
        "num_requests": args.num_requests,
        "prefix_len" if w3_shaped else "max_input_len": args.max_input_len,
        "new_tokens" if w3_shaped else "max_output_len": args.max_output_len,
    }
    sizes = {name: value for name, value in sizes.items() if value is not None}
    make = w3 if args.workload == "w3" else w1
    workload = make(**sizes, max_token_id=max_token_id)
    description = {"description": make.__doc__.splitlines()[0], **sizes, **workload.describe()}
    description["temperature"] = args.temperature
    if args.repetition_penalty != 1.0:
        description["repetition_penalty_run"] = args.repetition_penalty
    return workload, description


def measure(
    build: Callable[[], System],
    workload: Workload,
    batch: int,
    cost: MemoryCost,
    bandwidth: float,
    device: torch.device,
    replicas: int = 1,
) -> dict:
    """Build, warm up on ``batch`` other prompts, then time one run over ``workload``; the
    floor counts a common prefix once a step when the system caches prefixes, and of
    ``replicas`` data-parallel replicas the slowest one's share (each reads its own weights)."""
    system, startup_s = common.timed(build, device)
    try:
        _, warmup_s = common.timed(
            lambda: system.run(warmup_requests(workload.head(batch))), device
        )
        tokens, seconds = common.timed(lambda: system.run(workload), device)
        described = system.describe()
        caching = described.get("engine_config", {}).get("enable_prefix_caching", False)
        floor_s = max(cost.floor_bytes(part, caching) for part in workload.dealt(replicas)
                      ) / bandwidth
        figures = {
            "num_requests": len(workload.prompts),
            "output_tokens": tokens,
            "seconds": seconds,
            "output_tokens_per_s": tokens / seconds,
            "startup_s": startup_s,
            "warmup_s": warmup_s,
            "floor_s": floor_s,
            "fraction_of_floor": floor_s / seconds,
            **described,
        }
        print(  # before closing: a close that hangs leaves the figure in the log
            f"  {tokens} tokens in {seconds:.2f} s: {tokens / seconds:,.1f} tok/s "
            f"(start-up {startup_s:.1f} s, warm-up {warmup_s:.1f} s)", flush=True
        )
    finally:
        system.close()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, BASELINES)
    parser.add_argument("--workload", choices=["w1", "w3", "w4"], default="w1")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+",
                        help="one hf_paged run per size (default: 1, 2 and 4 for w4, else 1)")
    parser.add_argument("--data-parallel-size", type=int, nargs="+",
                        help="one run per number of replicas (each on tensor_parallel_size "
                        "GPUs), with their scaling over the size-1 run")
    parser.add_argument("--weak-scaling", action="store_true",
                        help="with --data-parallel-size: N replicas run N times the workload's "
                        "requests, a whole workload's load for each")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--max-input-len", type=int, help="W1 prompt length bound; W3 prefix")
    parser.add_argument("--max-output-len", type=int, help="W1 output length bound; W3 new tokens")
    parser.add_argument("--baseline-requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="generate baselines' batch")
    parser.add_argument(
        "--temperature", type=float,
        help="sampling temperature of every system (W1 default 0.6, as nano-vllm's bench "
        "samples, with a greedy hf_paged line beside it; W3 default 0: greedy)")
    parser.add_argument(
        "--extra-lines", nargs="*", choices=EXTRA_LINES, default=list(EXTRA_LINES),
        help="W1 at a temperature: the hf_paged lines beside the main one, each a full run "
        "(default: all; none when the flag has no value)")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="W1: also run hf_paged with this repetition penalty on every request")
    args = parser.parse_args(argv)
    if args.temperature is None:
        args.temperature = 0.6 if args.workload == "w1" else 0.0

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    workload, description = build_workload(args, common.max_token_id(args.model))
    options = common.engine_options(args.engine_option)
    cost = MemoryCost.from_checkpoint(args.model, dtype,
                                      options.get("kv_cache_dtype", "auto"))
    result = common.ResultFile(args.workload, args, device, summary)
    result["workload_description"] = description
    result["floor"] = floor_settings(device, args.bandwidth, cost)
    few = workload.head(args.baseline_requests)
    with_baselines = bool(args.baselines) or args.reuse_baselines is not None
    result["baseline_requests"] = len(few.prompts) if with_baselines else None
    common.reuse_baselines(result, args)

    def measure_on(requests: Workload, build: Callable[[], System], ranks: int = 1,
                   replicas: int = 1):
        bandwidth = result["floor"]["bandwidth_bytes_per_s"] * ranks  # every rank reads at once
        return partial(measure, build, requests, args.batch_size, cost, bandwidth, device,
                       replicas)

    sampling = {"temperature": args.temperature}
    paged = partial(PagedSystem, args.model, dtype, device, sampling=sampling, **options)
    tp_sizes = args.tensor_parallel_size or ([1, 2, 4] if args.workload == "w4" else [1])
    if args.workload == "w3":
        settings = {
            f"prefix_caching_{s}": {"enable_prefix_caching": s == "on"} for s in ("on", "off")
        }
    else:
        settings = {"hf_paged": {}}
        if args.temperature and args.workload != "w4":  # W4: one line per size
            settings.update({line: EXTRA_LINES[line] for line in args.extra_lines})
        if args.repetition_penalty != 1.0:
            penalty = {**sampling, "repetition_penalty": args.repetition_penalty}
            settings["repetition_penalty"] = {"sampling": penalty}
    if tp_sizes != [1] or args.workload == "w4":  # one run per size, each setting
        settings = {
            (f"tensor_parallel_size_{n}" if label == "hf_paged" else f"{label}_tp{n}"):
            dict(extra, tensor_parallel_size=n)
            for n in tp_sizes for label, extra in settings.items()
        }
    if args.data_parallel_size:  # one run per number of replicas, each setting
        settings = {
            (f"data_parallel_size_{n}" if label == "hf_paged" else f"{label}_dp{n}"):
            dict(extra, data_parallel_size=n)
            for n in args.data_parallel_size for label, extra in settings.items()
        }
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    skipped = {label: f"{gpus} GPU(s) visible" for label, extra in settings.items()
               if gpus is not None and _gpus(extra) > gpus}
    if skipped:
        print(f"{args.workload}: skipped {', '.join(skipped)} ({gpus} GPU(s) visible)")
        result["skipped"] = skipped
        settings = {label: extra for label, extra in settings.items() if label not in skipped}
    def workload_for(replicas: int) -> Workload:
        if not args.weak_scaling or replicas == 1:
            return workload
        scaled = argparse.Namespace(**{**vars(args),
                                       "num_requests": len(workload.prompts) * replicas})
        return build_workload(scaled, common.max_token_id(args.model))[0]

    if args.weak_scaling:
        if args.workload == "w3" or not args.data_parallel_size:
            parser.error("--weak-scaling takes --data-parallel-size and W1 or W4")
        description["weak_scaling"] = True
    runs = {
        label: measure_on(workload_for(extra.get("data_parallel_size", 1)),
                          partial(paged, **extra), extra.get("tensor_parallel_size", 1),
                          extra.get("data_parallel_size", 1))
        for label, extra in settings.items()
    }
    if with_baselines:
        first = next(iter(settings.values()))
        runs[SAME_REQUESTS] = measure_on(few, partial(paged, **first),
                                         first.get("tensor_parallel_size", 1))
    for label, run in runs.items():
        print(f"{args.workload} {label}")
        result["hf_paged"][label] = run()
        result.save()

    max_cache_len = max(map(len, few.prompts)) + max(few.max_new_tokens)
    generate = partial(GenerateSystem, args.model, dtype, device, args.batch_size,
                       temperature=args.temperature)
    common.run_baselines(
        result,
        args,
        {
            "generate": measure_on(few, generate),
            "static": measure_on(few, partial(generate, static=True, max_cache_len=max_cache_len)),
            "cb": measure_on(
                few, partial(ContinuousBatchingSystem, args.model, dtype, device, few,
                             temperature=args.temperature)
            ),
        },
    )
    if "data_parallel_size_1" in result["hf_paged"]:  # each size's throughput over one GPU's
        one = result["hf_paged"]["data_parallel_size_1"]["output_tokens_per_s"]
        result["data_parallel_scaling"] = {
            label: figures["output_tokens_per_s"] / one
            for label, figures in result["hf_paged"].items()
            if label.startswith("data_parallel_size_")}
    if args.workload == "w3" and len(settings) == 2:
        on, off = (result["hf_paged"][label]["output_tokens_per_s"] for label in settings)
        result["prefix_caching_speedup"] = on / off
    common.finish(result)


def _gpus(setting: dict) -> int:
    return setting.get("tensor_parallel_size", 1) * setting.get("data_parallel_size", 1)


def summary(data: dict) -> list[dict]:
    """The table lines: hf_paged's output tok/s on the whole workload (one line per engine
    setting), and on the first line the baselines with hf_paged's speedup on their requests."""
    same = data["hf_paged"].get(SAME_REQUESTS)
    labels = [label for label in data["hf_paged"] if label != SAME_REQUESTS]
    rows = []
    for i, label in enumerate(labels):
        figures = data["hf_paged"][label]
        rows.append(
            summary_row(
                "output tok/s" + ("" if label == "hf_paged" else f", {label.replace('_', ' ')}"),
                figures["output_tokens_per_s"],
                data["baselines"] if i == 0 else {},
                "output_tokens_per_s",
                floor=figures["output_tokens"] / figures["floor_s"],
                higher_is_better=True,
                compare=None if same is None else same["output_tokens_per_s"],
            )
        )
    return rows


if __name__ == "__main__":
    main()
