"""Paged decode attention against the memory bandwidth: at W1-like batches (256 sequences,
contexts drawn from 100 to 2,048 tokens, bf16 queries, the engine's block size), the kernel's
time over the bytes it must read (every sequence's K and V once, the queries) and write (the
outputs), as a fraction of the device's measured copy bandwidth; over a bf16 cache and over an
FP8 one (``kv_cache_dtype="fp8"``: one byte an element, per-KV-head scales). With
``--sweep-batches``, also
smaller batches (W1's tail: fewer sequences, longer contexts) at the split-K policy's choice and
at each of ``--splits``. Writes ``attention-decode-<device>.json``.

usage: python -m benchmarks.bench_attention [--batch 256] [--repeats 50]
           [--sweep-batches 16 32 64 128 --sweep-context 800 2048 --splits 1 2 4 8]
"""

from __future__ import annotations

import argparse
import itertools
import random
from pathlib import Path

import torch

from benchmarks.common import device_info, git_commit, write_result
from benchmarks.floor import measure_copy_bandwidth
from benchmarks.timing import graph_seconds
from hf_paged.config import EngineConfig
from hf_paged.kernels.attention import DECODE_TILE, paged_attention
from hf_paged.kernels.decode_attention import decode_splits
from hf_paged.kernels.reference import quantize_kv
from hf_paged.modeling.attention import decode_order

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIM = 128
# (query heads, KV heads): the 0.6B and 8B shapes' GQA groups of two and four.
SHAPES = [(16, 8), (32, 8)]


def decode_batch(lengths: list[int], heads: int, kv_heads: int, page: int, device,
                 fp8: bool = False):
    """Queries and a paged cache holding each sequence's context in randomly placed blocks
    (``fp8``: quantized with scales per KV head, which end the tuple)."""
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
    batch = (query, *cache, cu, seq_lens, tables.to(device))
    if not fp8:
        return batch
    scales = [c.float().abs().amax(dim=(0, 1, 3)) / 200 for c in cache]
    cache = [quantize_kv(c.flatten(0, 1), s).view(c.shape) for c, s in zip(cache, scales)]
    return (query, *cache, cu, seq_lens, tables.to(device), *scales)


def kernel_seconds(args: tuple, repeats: int, num_splits: int | None = None) -> float:
    """Mean time of one decode attention call, replayed from a CUDA graph, its programs
    started longest context first as the engine starts them."""
    scale = HEAD_DIM**-0.5
    order = torch.from_numpy(decode_order(args[4].tolist())).to(args[4].device)
    scales = dict(zip(("k_scale", "v_scale"), args[6:]))
    return graph_seconds(lambda: paged_attention(
        *args[:6], scale, max_query_len=1, num_splits=num_splits, order=order, **scales),
        repeats)


def fraction(lengths: list[int], heads: int, kv_heads: int, seconds: float,
             bandwidth: float, kv_element_bytes: int = 2) -> tuple[int, float]:
    """Bytes the call must move (every sequence's K and V once, queries in, outputs out), and
    the fraction of ``bandwidth`` that moving them in ``seconds`` reaches."""
    kv_bytes = sum(lengths) * kv_heads * HEAD_DIM * 2 * kv_element_bytes  # K and V
    io_bytes = 2 * len(lengths) * heads * HEAD_DIM * 2
    return kv_bytes + io_bytes, (kv_bytes + io_bytes) / seconds / bandwidth


def split_sweep(args, page: int, device, bandwidth: float) -> list[dict]:
    """Each ``--sweep-batches`` batch (16/8 heads) at the policy's split count and at each of
    ``--splits``."""
    rng = random.Random(1)
    heads, kv_heads = SHAPES[0]
    rows = []
    for size in args.sweep_batches:
        lengths = [rng.randint(*args.sweep_context) for _ in range(size)]
        batch = decode_batch(lengths, heads, kv_heads, page, device)
        max_tiles = -(-batch[-1].shape[1] * page // DECODE_TILE[1])
        policy = decode_splits(size * kv_heads, max_tiles, device)
        figures = {}
        for splits in [None, *args.splits]:
            seconds = kernel_seconds(batch, args.repeats, splits)
            figures["policy" if splits is None else str(splits)] = {
                "kernel_us": round(seconds * 1e6, 2),
                "fraction_of_copy_bandwidth": round(
                    fraction(lengths, heads, kv_heads, seconds, bandwidth)[1], 3)}
        rows.append({"batch": size, "query_heads": heads, "kv_heads": kv_heads,
                     "policy_splits": policy, "by_splits": figures})
        print(f"batch {size}: policy {policy} splits; "
              + ", ".join(f"{k}: {v['fraction_of_copy_bandwidth']:.1%}"
                          for k, v in figures.items()), flush=True)
        del batch
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sweep-batches", type=int, nargs="*", default=[])
    parser.add_argument("--sweep-context", type=int, nargs=2, default=[800, 2048])
    parser.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    page = EngineConfig().block_size
    bandwidth = measure_copy_bandwidth(device)
    rng = random.Random(0)
    lengths = [rng.randint(args.min_context, args.max_context) for _ in range(args.batch)]
    rows = []
    for (heads, kv_heads), cache in itertools.product(SHAPES, ("bfloat16", "fp8")):
        batch = decode_batch(lengths, heads, kv_heads, page, device, fp8=cache == "fp8")
        seconds = kernel_seconds(batch, args.repeats)
        moved, share = fraction(lengths, heads, kv_heads, seconds, bandwidth,
                                batch[1].element_size())
        rows.append({"query_heads": heads, "kv_heads": kv_heads, "head_dim": HEAD_DIM,
                     "kv_cache_dtype": cache, "kernel_us": round(seconds * 1e6, 2),
                     "bytes": moved, "achieved_bytes_per_s": moved / seconds,
                     "fraction_of_copy_bandwidth": round(share, 3)})
        print(f"decode attention {heads}/{kv_heads} heads, {cache} cache: "
              f"{seconds * 1e6:.1f} us, {moved / seconds / 1e12:.2f} TB/s, {share:.1%} of copy "
              "bandwidth", flush=True)
        del batch
    info = device_info(device)
    result = {
        "workload": "attention-decode", "git_commit": git_commit(), "device": info,
        "batch": args.batch, "context_tokens": [args.min_context, args.max_context],
        "total_context_tokens": sum(lengths), "block_size": page, "dtype": "bfloat16",
        "copy_bandwidth_bytes_per_s": bandwidth, "shapes": rows,
    }
    if args.sweep_batches:
        result["split_sweep"] = {"context_tokens": args.sweep_context,
                                 "batches": split_sweep(args, page, device, bandwidth)}
    path = args.results_dir / f"attention-decode-{info['slug']}.json"
    write_result(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
