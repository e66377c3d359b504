"""Where a step's time goes: host phases (schedule, input preparation, graph replay, sampling
launch, waiting for the previous step's tokens, bookkeeping) and device kernels, for four cases
of the W1/W2 workloads: decode at batch 1, decode at batch 256, a 1,024-token prefill and an
8,192-token one (eight prompts: W1's step budget).

    python -m benchmarks.profile_steps --model /tmp/ckpt/0.6b
    python -m benchmarks.profile_steps --model /tmp/ckpt/8b --tensor-parallel-size 2 \
        --name w4-profile-tp2
    python -m benchmarks.profile_steps --model /tmp/ckpt/30b-a3b-24 --name profile-30b-a3b

Writes ``<results>/<name>-<device>.json``: per case, milliseconds per step of wall time (steps
are not synchronised, so in steady state this is the step period), of each host phase, of device
kernel time (a second run, synchronised, under the profiler), and the ten costliest kernels.
``collect`` is time the host spends waiting for the device: the slack left after host work.
With tensor parallelism the kernels are rank 0's, and ``collective_ms_per_step`` is the time of
its collective kernels (NCCL's and the symmetric-memory all-reduce's): the all-reduces (waiting
for the slowest rank included) and the logits gather. ``moe_ms_per_step`` is the time of the
mixture-of-experts kernels (routing and experts: their names hold "moe"), 0 for a dense model.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import hf_paged
from benchmarks import common
from hf_paged.sampling_params import SamplingParams

PHASES = [("scheduler", "schedule"), ("executor.runner", "prepare"),
          ("executor.runner.decode_graphs", "run"), ("executor.runner.sampler", "sample"),
          ("executor.runner", "collect"), ("scheduler", "postprocess")]


def attribute(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def run_case(engine, prompts, new_tokens, measure_steps, on_measured) -> None:
    """Run ``prompts`` to the end, calling ``on_measured(step)`` for the selected steps."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    index = 0
    while engine.has_unfinished_requests():
        if measure_steps(index):
            on_measured(engine.step)
        else:
            engine.step()
        index += 1


def profile_case(engine, make_prompts, new_tokens: int, measure_steps) -> dict:
    """Host phases and wall time of the steps selected by ``measure_steps(step_index)``, then
    their device kernels in a second run of the same shapes (fresh prompts: no prefix cache
    hits) under the profiler."""
    totals: dict[str, float] = defaultdict(float)
    on = [False]
    for owner, name in PHASES:
        obj = attribute(engine, owner)
        fn = getattr(obj, name)
        label = f"{owner.split('.')[-1]}.{name}" if "." in owner else name  # decode_graphs.run

        def wrapper(*args, fn=fn, label=label, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if on[0]:
                    totals[label] += time.perf_counter() - start

        setattr(obj, name, wrapper)
    steps = [0]

    def timed_step(step):
        on[0] = True
        start = time.perf_counter()
        step()
        totals["step"] += time.perf_counter() - start
        on[0] = False
        steps[0] += engine.in_flight is not None  # per launched step (the last launches none)

    run_case(engine, make_prompts(), new_tokens, measure_steps, timed_step)
    for owner, name in PHASES:
        attribute(engine, owner).__dict__.pop(name)

    kernels: dict[str, float] = defaultdict(float)
    run_case(engine, make_prompts(), new_tokens, measure_steps,
             lambda step: add_kernel_times(step, kernels))
    n = max(steps[0], 1)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {
        "measured_steps": steps[0],
        "collective_ms_per_step": sum(v for k, v in kernels.items() if _collective(k)) / n,
        "moe_ms_per_step": sum(v for k, v in kernels.items() if "moe" in k.lower()) / n,
        "wall_ms_per_step": 1e3 * totals.pop("step") / n,
        "host_ms_per_step": {k: 1e3 * v / n for k, v in totals.items()},
        "device_kernel_ms_per_step": sum(kernels.values()) / n,
        "top_kernels_ms_per_step": {k: v / n for k, v in top},
    }


def add_kernel_times(step: Callable[[], object], kernels: dict[str, float]) -> None:
    """Run ``step()`` under the profiler, synchronised, adding its CUDA kernels' times (ms)
    to ``kernels`` by name."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            kernels[e.key] += e.device_time_total / 1e3


def _collective(kernel: str) -> bool:
    """NCCL's kernels, and the symmetric-memory all-reduce's."""
    name = kernel.lower()
    return "nccl" in name or "all_reduce" in name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--name", default="profile", help="the result file's name before the "
                        "device (default: profile)")
    args = parser.parse_args()
    device = torch.device("cuda")
    engine = hf_paged.from_pretrained(args.model, dtype=torch.bfloat16, progress_bar=False,
                                      tensor_parallel_size=args.tensor_parallel_size)
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int):
        return lambda: torch.randint(0, 10000, (n, length), generator=gen).tolist()

    engine.generate_tokens(prompts(4, 1024)(), SamplingParams(max_new_tokens=8))  # warm-up
    try:
        cases = profile_cases(engine, prompts)
    finally:
        engine.close()
    result = {"device": common.device_info(device), "git_commit": common.git_commit(),
              "checkpoint": args.model, "tensor_parallel_size": args.tensor_parallel_size,
              "cases": cases}
    out = args.results_dir / f"{args.name}-{result['device']['slug']}.json"
    common.write_result(out, result)
    print(json.dumps(cases, indent=1))


def profile_cases(engine, prompts) -> dict:
    """Decode at batch 1 and 256, a lone 1,024-token prefill, and a W1-sized prefill step
    (eight 1,024-token prompts: 8,192 tokens, W1's step budget)."""
    return {
        # steps 20..69: decode only
        "decode_batch_1": profile_case(engine, prompts(1, 512), 80, lambda i: 20 <= i < 70),
        "decode_batch_256": profile_case(engine, prompts(256, 256), 80, lambda i: 50 <= i < 75),
        # step 0 of a lone 1,024-token prompt is its whole prefill; step 1 collects its token
        "prefill_1024": profile_case(engine, prompts(1, 1024), 1, lambda i: i < 2),
        "prefill_8x1024": profile_case(engine, prompts(8, 1024), 1, lambda i: i < 2),
    }


if __name__ == "__main__":
    main()
