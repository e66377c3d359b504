"""The projections of small decode batches: cuBLAS (``F.linear``, plus ``silu_and_mul`` for the
merged gate/up) against the small-M Triton kernels, on the real matrices of a shape.

Each case replays a CUDA graph of 100 calls cycling over enough copies of the weight to
overflow the L2 cache (as a model's layers do), so the time per call is what a decode graph
pays. Reports microseconds per call and the fraction of the device's copy bandwidth the weight
reads reach. Writes ``<results>/small-m-<shape>-<device>.json``.

    python -m benchmarks.bench_small_m --shape 0.6b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import common
from hf_paged import kernels
from hf_paged.kernels.small_m import MAX_ROWS
from hf_paged.random_checkpoint import SHAPES

_CALLS = 100
_L2_BYTES = 256 * 2**20  # more than any current GPU's L2 cache


def matrices(shape: str) -> dict[str, tuple[int, int]]:
    """Name -> (output features, input features) of one decoder layer's projections."""
    s = SHAPES[shape]
    hidden, heads, kv, d = (s["hidden_size"], s["num_attention_heads"],
                            s["num_key_value_heads"], s["head_dim"])
    return {"qkv": ((heads + 2 * kv) * d, hidden), "o": (hidden, heads * d),
            "gate_up": (2 * s["intermediate_size"], hidden),
            "down": (hidden, s["intermediate_size"])}


def time_per_call(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Seconds per call of ``fn(x, weight)`` replayed from a graph over the weights in turn."""
    for w in weights:  # compile and warm up outside the capture
        fn(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(_CALLS):
            fn(x, weights[i % len(weights)])
    graph.replay()
    _, seconds = common.timed(lambda: [graph.replay() for _ in range(10)], x.device)
    return seconds / (10 * _CALLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--results-dir", default=common.RESULTS_DIR, type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = common.measure_copy_bandwidth(device)
    cases = []
    for name, (n, k) in matrices(args.shape).items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
                   for _ in range(max(2, -(-_L2_BYTES // nbytes)))]
        if name == "gate_up":
            ours, cublas = kernels.gated_linear, lambda x, w: kernels.silu_and_mul(F.linear(x, w))
        else:
            ours, cublas = kernels.linear, F.linear
        for rows in (1, 2, 4, MAX_ROWS):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            torch.testing.assert_close(ours(x, weights[0]), cublas(x, weights[0]),
                                       rtol=2e-2, atol=2e-2)
            row = {"matrix": name, "out_features": n, "in_features": k, "rows": rows}
            for label, fn in (("cublas", cublas), ("small_m", ours)):
                seconds = time_per_call(fn, weights, x)
                row[f"{label}_us"] = seconds * 1e6
                row[f"{label}_fraction_of_bandwidth"] = nbytes / seconds / bandwidth
            cases.append(row)
            print(f"{name:8s} {n:6d}x{k:<6d} rows {rows}: cuBLAS {row['cublas_us']:6.2f} us, "
                  f"small-M {row['small_m_us']:6.2f} us "
                  f"({row['small_m_fraction_of_bandwidth']:.0%} of bandwidth)")
    result = {"device": common.device_info(device), "git_commit": common.git_commit(),
              "shape": args.shape, "copy_bandwidth_bytes_per_s": bandwidth, "cases": cases}
    out = args.results_dir / f"small-m-{args.shape}-{result['device']['slug']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
