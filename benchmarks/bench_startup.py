"""Start-up time: ``from_pretrained`` to a ready engine, on a fresh machine and a warm one.

    python -m benchmarks.bench_startup --model /tmp/ckpt/0.6b

Each start runs in a process of its own with ``TRITON_CACHE_DIR`` and ``HF_PAGED_CACHE_DIR``
pointing at one new folder: the first start finds it empty (a fresh machine: every kernel
variant compiles, the projections are timed), the later ones find what the first left there
(a warm machine). Reports the wall time of ``from_pretrained`` and the engine's
``startup_seconds`` by stage, into ``startup-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import common
from benchmarks.summary import summary_row

# Run in the child: one engine start, its timings as the last line of output.
_CHILD = """
import json, sys, time, torch, hf_paged
start = time.perf_counter()
engine = hf_paged.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]),
                                  **json.loads(sys.argv[3]))
total = time.perf_counter() - start
print(json.dumps({"total_s": total, "stages_s": engine.startup_seconds}))
engine.close()
"""


def start_once(args: argparse.Namespace, cache_dir: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, HF_PAGED_CACHE_DIR=cache_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, args.model, args.dtype,
         json.dumps(common.engine_options(args.engine_option))],
        env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"engine start failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, baselines=())
    parser.add_argument("--warm-starts", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = common.ResultFile("startup", args, device, summarize)
    result["workload_description"] = {
        "description": "from_pretrained to a ready engine, each start in its own process; "
                       "fresh: empty Triton and hf_paged caches, warm: the caches the fresh "
                       "start filled",
        "engine_options": common.engine_options(args.engine_option),
    }
    with tempfile.TemporaryDirectory() as cache_dir:
        fresh = start_once(args, cache_dir)
        print("fresh", fresh, flush=True)
        warm = []
        for _ in range(args.warm_starts):
            warm.append(start_once(args, cache_dir))
            print("warm", warm[-1], flush=True)
    result["hf_paged"] = {"hf_paged": {
        "fresh": fresh, "warm": warm,
        "fresh_s": fresh["total_s"],
        "warm_s": statistics.median(w["total_s"] for w in warm) if warm else None,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }}
    common.finish(result)


def summarize(data: dict) -> list[dict]:
    figures = data["hf_paged"]["hf_paged"]
    rows = [("start-up s, fresh caches", figures["fresh_s"]),
            ("start-up s, warm caches", figures["warm_s"])]
    return [summary_row(metric, seconds, {}, "", None, higher_is_better=False)
            for metric, seconds in rows if seconds is not None]


if __name__ == "__main__":
    main()
