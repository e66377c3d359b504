"""W1 under memory pressure: the same requests with the KV cache sized by free memory and with
a cache too small to hold them all (forcing preemption), then a token-by-token comparison.

    python -m benchmarks.check_preemption --model /tmp/ckpt/0.6b --num-kv-blocks 500

Preempted requests are recomputed as prefills and every step batches differently, so the two
runs sum in different orders; they agree exactly only where no step is a near-tie. The check
runs in float32 by default, where near-ties are rare, and judges each request that differs by
transformers' own logits at its first differing token: the two candidates must lie within
``NEAR_TIE`` of each other. Writes ``<results>/w1-preemption-<device>.json``: both runs' wall
time and stats, how many requests came out identical, and for each that differs, the first
differing token and its logit gap; exits 1 if a divergence is not a near-tie.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_paged
from benchmarks import common
from benchmarks.workloads import w1
from hf_paged.sampling_params import SamplingParams

# Logit gaps within which summation order alone may swap two tokens, by dtype.
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def run(path: str, workload, dtype: torch.dtype, **options) -> tuple[list[list[int]], dict]:
    engine = hf_paged.from_pretrained(path, dtype=dtype, **options)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
    start = time.perf_counter()
    outputs = engine.generate_tokens(workload.prompts, params, progress_bar=False)
    seconds = time.perf_counter() - start
    stats = {**engine.stats(), "seconds": seconds,
             "output_tokens_per_s": sum(map(len, outputs)) / seconds}
    del engine
    common.free_memory()
    print(f"{options or 'unconstrained'}: {seconds:.1f} s, "
          f"{stats['num_preemptions']} preemptions", flush=True)
    return outputs, stats


@torch.inference_mode()
def divergence_gaps(path: str, dtype: torch.dtype, device: torch.device, prompts, free, small,
                    differing: list[int]) -> list[dict]:
    """For each differing request, transformers' logit gap between the two runs' tokens at
    the first position where they part, given the tokens both agree on before it."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    found = []
    for i in differing:
        j = next(j for j, (x, y) in enumerate(zip(free[i], small[i])) if x != y)
        ids = torch.tensor([prompts[i] + free[i][:j]], device=device)
        logits = model(ids, logits_to_keep=1).logits[0, -1].float()
        gap = abs(float(logits[free[i][j]] - logits[small[i][j]]))
        found.append({"request": i, "first_differing_token": j, "logit_gap": gap})
    del model
    common.free_memory()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=500,
                        help="the constrained cache (64-token blocks: 500 hold 32k tokens)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workload = w1(max_token_id=common.max_token_id(args.model)).head(args.num_requests)
    free, free_stats = run(args.model, workload, dtype)
    small, small_stats = run(args.model, workload, dtype, num_kv_blocks=args.num_kv_blocks)
    differing = [i for i, (a, b) in enumerate(zip(free, small)) if a != b]
    diffs = divergence_gaps(args.model, dtype, device, workload.prompts, free, small, differing)
    near_ties = all(d["logit_gap"] < NEAR_TIE[dtype] for d in diffs)
    result = {
        "workload": "w1-preemption",
        "device": common.device_info(device),
        "git_commit": common.git_commit(),
        "dtype": args.dtype,
        "num_requests": len(workload.prompts),
        "output_tokens": sum(map(len, free)),
        "unconstrained": free_stats,
        "constrained": {**small_stats, "num_kv_blocks": args.num_kv_blocks},
        "identical_requests": len(workload.prompts) - len(differing),
        "near_tie": NEAR_TIE[dtype],
        "every_divergence_is_a_near_tie": near_ties,
        "differing_requests": diffs,
    }
    out = args.results_dir / f"w1-preemption-{result['device']['slug']}.json"
    common.write_result(out, result)
    keys = ("dtype", "identical_requests", "num_requests", "every_divergence_is_a_near_tie")
    print(json.dumps({k: result[k] for k in keys}),
          "preemptions:", small_stats["num_preemptions"],
          f"tok/s free {free_stats['output_tokens_per_s']:.0f} "
          f"small {small_stats['output_tokens_per_s']:.0f}")
    if not near_ties:
        raise SystemExit("a request parted from the unconstrained run at a clear choice")


if __name__ == "__main__":
    main()
