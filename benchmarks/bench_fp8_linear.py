"""FP8 projections (block-quantized float8_e4m3fn weights, 128x128 scale blocks) on the
projection shapes of Qwen3-0.6B and Qwen3-8B: at decode's 1-8 rows the small-M kernel reading
FP8 against itself reading bf16 and against cuBLAS (bf16); at more rows the two block-scaled
GEMMs (dequantize-in-the-tile, and w8a8 with its activation quantization) against cuBLAS
(bf16). Each figure is a CUDA graph replaying the projection over enough copies of the weight
that they stream from memory (more than the L2 holds), set against its floor: the bytes it must
move (weight, scales, input and output) over the measured copy bandwidth, or its FLOPs over the
device's dense peak (FP8's for w8a8, bf16's otherwise), whichever is larger. Also the largest
difference of each FP8 kernel from its plain-torch twin. Writes ``fp8-linear-<device>.json``.

usage: python -m benchmarks.bench_fp8_linear [--models 0.6b 8b] [--small 1 2 4 8]
                                             [--gemm 16 64 256 1024 4096]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import device_info, device_name, git_commit, write_result
from benchmarks.floor import measure_copy_bandwidth
from benchmarks.timing import graph_seconds

ROOT = Path(__file__).resolve().parent.parent
# (hidden, intermediate, query heads, KV heads, head dim) of the Qwen3 checkpoints.
MODELS = {"0.6b": (1024, 3072, 16, 8, 128), "8b": (4096, 12288, 32, 8, 128)}
# Dense (no sparsity) tensor-core peaks by a substring of the device name, from NVIDIA's H100
# and H200 datasheets; the PCIe H100 first, as its name also holds "H100".
PEAK_FLOPS = {"H100 PCIe": {"bf16": 756e12, "fp8": 1513e12},
              "H100": {"bf16": 989e12, "fp8": 1979e12},
              "H200": {"bf16": 989e12, "fp8": 1979e12}}
STREAMED_BYTES = 256 * 2**20  # weight copies per timing: several times any L2


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """``{name: (N, K)}`` of a layer's projections, merged as hf_paged runs them."""
    hidden, inter, heads, kv_heads, head_dim = MODELS[model]
    return {"qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter)}


def floor_seconds(n: int, k: int, rows: int, weight_bytes: float, bandwidth: float,
                  peak_flops: float | None) -> float:
    """The larger of moving the weight (``weight_bytes`` an element, scales included), a
    bf16 input and a bf16 output at ``bandwidth``, and the product's FLOPs at the peak."""
    nbytes = n * k * weight_bytes + 2 * rows * (n + k)
    return max(nbytes / bandwidth, 2 * rows * n * k / peak_flops if peak_flops else 0.0)


def fp8_bytes_per_element() -> float:
    """A float8 weight element with its share of the float32 scale of its 128x128 block."""
    return 1 + 4 / 128**2


def quantized(weight: torch.Tensor):
    """``weight`` in float8_e4m3fn with its 128x128 block scales (amax / 448 per block)."""
    from hf_paged.kernels.block_scales import FP8, FP8_MAX, BlockScales, grid_rows

    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % 128, 0, -n % 128))
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.flatten(2).flatten(0, 1)[:n, :k].contiguous()
    return q, BlockScales(inv.contiguous(), grid_rows([n], 128, weight.device), 128)


def timing(run: Callable[[torch.Tensor, object], torch.Tensor], x: torch.Tensor,
           weights: list, repeats: int) -> float:
    """Seconds per projection, over every copy of the weight in turn, from a CUDA graph."""

    def step():
        for w in weights:
            run(x, w)

    return graph_seconds(step, repeats) / len(weights)


def measure_shape(name: str, n: int, k: int, args, bandwidth: float, peaks: dict | None
                  ) -> dict:
    from hf_paged.kernels import fp8_gemm, reference, small_m

    bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    q, scales = quantized(bf16)
    copies = max(2, STREAMED_BYTES // (n * k * 2))
    bf16s = [bf16.clone() for _ in range(copies)]
    fp8s = [(q.clone(), scales) for _ in range(2 * copies)]
    kernels_by_phase = {
        "small": {"cublas_bf16": (lambda x, w: F.linear(x, w), bf16s, 2.0, "bf16"),
                  "small_m_bf16": (small_m.linear, bf16s, 2.0, "bf16"),
                  "small_m_fp8": (lambda x, w: small_m.linear(x, *w), fp8s, None, "bf16")},
        "gemm": {"cublas_bf16": (lambda x, w: F.linear(x, w), bf16s, 2.0, "bf16"),
                 "dequant_fp8": (lambda x, w: fp8_gemm.dequant_linear(x, *w), fp8s, None,
                                 "bf16"),
                 "w8a8_fp8": (lambda x, w: fp8_gemm.w8a8_linear(x, *w), fp8s, None, "fp8")},
    }
    twins = {"small_m_fp8": reference.dequant_linear, "dequant_fp8": reference.dequant_linear,
             "w8a8_fp8": reference.w8a8_linear}
    rows_out = []
    for phase, row_counts in (("small", args.small), ("gemm", args.gemm)):
        for rows in row_counts:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            entry = {"projection": name, "n": n, "k": k, "rows": rows, "phase": phase}
            for kernel, (run, weights, size, peak) in kernels_by_phase[phase].items():
                seconds = timing(run, x, weights, args.repeats)
                size = size or fp8_bytes_per_element()
                floor = floor_seconds(n, k, rows, size, bandwidth,
                                      peaks[peak] if peaks and phase == "gemm" else None)
                entry[kernel] = {"us": round(seconds * 1e6, 2),
                                 "floor_us": round(floor * 1e6, 2),
                                 "fraction_of_floor": round(floor / seconds, 3)}
                if kernel in twins:
                    got = run(x, fp8s[0]).float()
                    want = twins[kernel](x, q, scales).float()
                    entry[kernel]["max_diff_over_max"] = (
                        (got - want).abs().max() / want.abs().max()).item()
            print(" ".join([f"{name} {n}x{k} {rows:>4} rows:"] + [
                f"{kernel} {v['us']:.1f} us ({v['fraction_of_floor']:.0%})"
                for kernel, v in entry.items() if isinstance(v, dict)]), flush=True)
            rows_out.append(entry)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--small", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--gemm", type=int, nargs="*", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = measure_copy_bandwidth(device)
    peaks = next((p for key, p in PEAK_FLOPS.items() if key in device_name(device)), None)
    info = device_info(device)
    result = {"workload": "fp8-linear", "git_commit": git_commit(), "device": info,
              "copy_bandwidth_bytes_per_s": bandwidth, "peak_flops": peaks,
              "floor_model": "max(bytes / copy bandwidth, 2*M*N*K / dense peak (fp8 for "
                             "w8a8, bf16 otherwise; GEMM rows only)); bytes = weight (fp8: "
                             "1 + 4/128^2 a element for the scales) + bf16 input and output",
              "rows": []}
    path = args.results_dir / f"fp8-linear-{info['slug']}.json"
    with torch.inference_mode():
        for model in args.models:
            for name, (n, k) in projection_shapes(model).items():
                for entry in measure_shape(name, n, k, args, bandwidth, peaks):
                    result["rows"].append({"model": model, **entry})
                write_result(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
