"""Paged decode attention against the memory bandwidth: at W1-like batches (256 sequences,
contexts drawn from 100 to 2,048 tokens, bf16, the engine's block size), the kernel's time
over the bytes it must read (every sequence's K and V once, the queries) and write (the
outputs), as a fraction of the device's measured copy bandwidth. Writes
``attention-decode-<device>.json``.

usage: python -m benchmarks.bench_attention [--batch 256] [--repeats 50]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from benchmarks.common import device_info, git_commit, write_result
from benchmarks.floor import measure_copy_bandwidth
from benchmarks.timing import graph_seconds
from hf_paged.config import EngineConfig
from hf_paged.kernels.attention import paged_attention

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIM = 128
# (query heads, KV heads): the 0.6B and 8B shapes' GQA groups of two and four.
SHAPES = [(16, 8), (32, 8)]


def decode_batch(lengths: list[int], heads: int, kv_heads: int, page: int, device):
    """Queries and a paged cache holding each sequence's context in randomly placed blocks."""
    blocks = [-(-n // page) for n in lengths]
    total = sum(blocks)
    gen = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[at: at + n]
        at += n
    cache = [torch.randn(total, page, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
             for _ in range(2)]
    query = torch.randn(len(lengths), heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return query, *cache, cu, seq_lens, tables.to(device)


def kernel_seconds(args: tuple, repeats: int) -> float:
    """Mean time of one decode attention call, replayed from a CUDA graph."""
    scale = HEAD_DIM**-0.5
    return graph_seconds(lambda: paged_attention(*args, scale, max_query_len=1), repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    page = EngineConfig().block_size
    bandwidth = measure_copy_bandwidth(device)
    rng = random.Random(0)
    lengths = [rng.randint(args.min_context, args.max_context) for _ in range(args.batch)]
    rows = []
    for heads, kv_heads in SHAPES:
        batch = decode_batch(lengths, heads, kv_heads, page, device)
        seconds = kernel_seconds(batch, args.repeats)
        kv_bytes = sum(lengths) * kv_heads * HEAD_DIM * 2 * 2  # K and V, bf16
        io_bytes = 2 * args.batch * heads * HEAD_DIM * 2  # queries read, outputs written
        achieved = (kv_bytes + io_bytes) / seconds
        rows.append({"query_heads": heads, "kv_heads": kv_heads, "head_dim": HEAD_DIM,
                     "kernel_us": round(seconds * 1e6, 2), "bytes": kv_bytes + io_bytes,
                     "achieved_bytes_per_s": achieved,
                     "fraction_of_copy_bandwidth": round(achieved / bandwidth, 3)})
        print(f"decode attention {heads}/{kv_heads} heads: {seconds * 1e6:.1f} us, "
              f"{achieved / 1e12:.2f} TB/s, {achieved / bandwidth:.1%} of copy bandwidth",
              flush=True)
        del batch
    info = device_info(device)
    result = {
        "workload": "attention-decode", "git_commit": git_commit(), "device": info,
        "batch": args.batch, "context_tokens": [args.min_context, args.max_context],
        "total_context_tokens": sum(lengths), "block_size": page, "dtype": "bfloat16",
        "copy_bandwidth_bytes_per_s": bandwidth, "shapes": rows,
    }
    path = args.results_dir / f"attention-decode-{info['slug']}.json"
    write_result(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
