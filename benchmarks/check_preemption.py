"""W1 under memory pressure: the same requests with the KV cache sized by free memory and with
a cache too small to hold them all (forcing preemption), then a token-by-token comparison.

    python -m benchmarks.check_preemption --model /tmp/ckpt/0.6b --num-kv-blocks 2000

Writes ``<results>/w1-preemption-<device>.json``: both runs' wall time and stats, how many
requests came out identical, and for the first twenty that differ, the first differing token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

import hf_paged
from benchmarks import common
from benchmarks.workloads import w1
from hf_paged.sampling_params import SamplingParams


def run(path: str, workload, **options) -> tuple[list[list[int]], dict]:
    engine = hf_paged.from_pretrained(path, dtype=torch.bfloat16, **options)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
    start = time.perf_counter()
    outputs = engine.generate_tokens(workload.prompts, params, progress_bar=False)
    seconds = time.perf_counter() - start
    stats = {**engine.stats(), "seconds": seconds,
             "output_tokens_per_s": sum(map(len, outputs)) / seconds}
    del engine
    common.free_memory()
    return outputs, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=2000,
                        help="the constrained cache (16-token blocks: 2,000 hold 32k tokens)")
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workload = w1(max_token_id=common.max_token_id(args.model)).head(args.num_requests)
    free, free_stats = run(args.model, workload)
    small, small_stats = run(args.model, workload, num_kv_blocks=args.num_kv_blocks)
    differing = [i for i, (a, b) in enumerate(zip(free, small)) if a != b]
    first_diffs = [
        {"request": i, "first_differing_token": next(
            j for j, (x, y) in enumerate(zip(free[i], small[i])) if x != y)}
        for i in differing[:20]
    ]
    result = {
        "workload": "w1-preemption",
        "device": common.device_info(device),
        "git_commit": common.git_commit(),
        "num_requests": len(workload.prompts),
        "output_tokens": sum(map(len, free)),
        "unconstrained": free_stats,
        "constrained": {**small_stats, "num_kv_blocks": args.num_kv_blocks},
        "identical_requests": len(workload.prompts) - len(differing),
        "differing_requests": first_diffs,
    }
    out = args.results_dir / f"w1-preemption-{result['device']['slug']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(out, Path(os.environ["OUT"]) / out.name)
    print(json.dumps({k: result[k] for k in ("identical_requests", "num_requests")}),
          "preemptions:", small_stats["num_preemptions"],
          f"tok/s free {free_stats['output_tokens_per_s']:.0f} "
          f"small {small_stats['output_tokens_per_s']:.0f}")


if __name__ == "__main__":
    main()
