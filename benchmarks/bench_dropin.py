"""Drop-in speed: the same unmodified transformers script (``dropin_script.py``: W1's first
64 requests through ``model.generate`` in batches of 64) run stock and through
``python -m hf_paged run``; writes ``dropin-<device>.json`` with both runs and the speedup.

usage: python -m benchmarks.bench_dropin --model CHECKPOINT [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import device_info, git_commit, write_result

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "benchmarks" / "dropin_script.py")
WAYS = {"transformers": [SCRIPT], "hf_paged run": ["-m", "hf_paged", "run", SCRIPT]}


def run(way: str, script_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    done = subprocess.run([sys.executable, *WAYS[way], *script_args], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{way} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    script_args = [args.model, "--num-requests", str(args.num_requests),
                   "--batch-size", str(args.batch_size)]
    runs = {}
    for way in WAYS:
        print(f"dropin: {way}", flush=True)
        runs[way] = run(way, script_args)
        print(json.dumps(runs[way]), flush=True)
    stock, paged = runs["transformers"], runs["hf_paged run"]
    if not paged["model_class"].startswith("hf_paged."):
        raise SystemExit(f"the patched run used {paged['model_class']}, not hf_paged's model")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = device_info(device)
    result = {
        "workload": "dropin", "git_commit": git_commit(), "device": info,
        "checkpoint": args.model, "runs": runs,
        "speedup": round(paged["output_tokens_per_s"] / stock["output_tokens_per_s"], 2),
    }
    path = args.results_dir / f"dropin-{info['slug']}.json"
    write_result(path, result)
    print(f"speedup of the patched script: x{result['speedup']}; wrote {path}")


if __name__ == "__main__":
    main()
