"""lm-evaluation-harness's ``generate_until`` through ``HFLM``, stock transformers against
hf_paged in the same run: the same requests (text prompts cut from the tokenizer's corpus,
greedy, ``until`` stop sequences, ``max_gen_toks``), the wall time of each and how many
generated strings are equal. Writes ``lm-eval-<device>.json``.

usage: python -m benchmarks.bench_lm_eval --model CHECKPOINT [--dtype float32]
       [--num-requests 128] [--batch-size 32] [--max-gen-toks 256]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import hf_paged
from benchmarks.common import device_info, free_memory, git_commit, write_result

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "hf_paged" / "data" / "tokenizer_corpus.txt"
UNTIL = ["\n\n", "Question:"]


def requests(num: int, max_gen_toks: int, seed: int = 0):
    """``num`` generate_until requests: contexts of 200-2,000 characters of the corpus."""
    from lm_eval.api.instance import Instance

    text = CORPUS.read_text()
    rng = random.Random(seed)
    out = []
    for i in range(num):
        length = rng.randint(200, 2000)
        start = rng.randint(0, len(text) - length)
        args = {"until": list(UNTIL), "max_gen_toks": max_gen_toks, "do_sample": False}
        out.append(Instance(request_type="generate_until", doc={}, arguments=(
            text[start: start + length], args), idx=i))
    return out


def run(lm, num: int, max_gen_toks: int) -> tuple[list[str], float]:
    reqs = requests(num, max_gen_toks)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    outputs = lm.generate_until(reqs, disable_tqdm=True)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return outputs, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-gen-toks", type=int, default=256)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(batch_size=args.batch_size, dtype=args.dtype, device=str(device))
    runs = {}
    for way in ("transformers", "hf_paged"):
        # Warm-up on a few requests (start-up, compilation), then the timed run.
        if way == "transformers":
            lm = HFLM(pretrained=args.model, **common)
        else:
            with hf_paged.patch_transformers():
                lm = HFLM(pretrained=args.model, **common)
            assert isinstance(lm.model, hf_paged.Qwen3ForCausalLM)
        run(lm, min(args.batch_size, 8), 16)
        outputs, seconds = run(lm, args.num_requests, args.max_gen_toks)
        # What the requests return, cut at their stop sequences (generation runs further).
        returned = sum(len(lm.tok_encode(o)) for o in outputs)
        runs[way] = {"seconds": round(seconds, 3), "outputs": outputs,
                     "returned_tokens": returned}
        print(f"lm-eval {way}: {seconds:.2f} s", flush=True)
        if way == "hf_paged":
            lm.model.close()
        del lm
        free_memory()
    stock, paged = runs["transformers"]["outputs"], runs["hf_paged"]["outputs"]
    equal = sum(a == b for a, b in zip(stock, paged))
    info = device_info(device)
    result = {
        "workload": "lm-eval generate_until", "git_commit": git_commit(), "device": info,
        "checkpoint": args.model, "dtype": args.dtype, "num_requests": args.num_requests,
        "batch_size": args.batch_size, "max_gen_toks": args.max_gen_toks, "until": UNTIL,
        "runs": {w: {k: v for k, v in r.items() if k != "outputs"} for w, r in runs.items()},
        "equal_outputs": equal,
        "speedup": round(runs["transformers"]["seconds"] / runs["hf_paged"]["seconds"], 2),
        "first_difference": next(({"index": i, "transformers": a, "hf_paged": b}
                                  for i, (a, b) in enumerate(zip(stock, paged)) if a != b), None),
    }
    path = args.results_dir / f"lm-eval-{args.dtype}-{info['slug']}.json"
    write_result(path, result)
    print(f"lm-eval generate_until: x{result['speedup']}, {equal}/{len(stock)} outputs equal; "
          f"wrote {path}")


if __name__ == "__main__":
    main()
