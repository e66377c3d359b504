"""The fused mixture-of-experts kernels on a Qwen3-30B-A3B layer (128 experts, 8 per token,
hidden 2,048, expert intermediate 768, bf16, random router logits): ``moe_experts`` replayed
from a CUDA graph at decode batches and prefill lengths, against the bytes it must move (the
weights of the experts the batch hits, counted from its routing, plus the tokens in and out)
as a fraction of the measured copy bandwidth, and at prefill its TFLOP/s against the device's
dense bf16 peak; in the same run transformers' ``Qwen3MoeExperts`` on the same weights and
routing, eager (its expert loop) and ``grouped_mm`` (what a model loaded with
``from_pretrained`` runs by default), timed with CUDA events, no graphs. The same experts
quantized to FP8 as transformers quantizes a checkpoint (``Fp8Quantize``: 128x128 blocks,
float32 ``weight_scale_inv``) go through the same kernels, their bytes counted at one a weight
plus the scales. Writes ``moe-kernels-<device>.json``.

usage: python -m benchmarks.bench_moe [--decode 1 4 16 64 256] [--prefill 2048 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from pathlib import Path

import torch
from transformers import FineGrainedFP8Config, Qwen3MoeConfig
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.common import device_info, device_name, git_commit, guarded, write_result
from benchmarks.floor import measure_copy_bandwidth
from benchmarks.timing import event_seconds, graph_seconds
from hf_paged.kernels.block_scales import BlockScales, grid_rows
from hf_paged.kernels.moe_gemm import moe_experts
from hf_paged.kernels.moe_routing import moe_route
from hf_paged.kernels.moe_tiles import moe_config

ROOT = Path(__file__).resolve().parent.parent
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
# Dense (no sparsity) bf16 tensor-core peak FLOP/s by a substring of the device name, from
# NVIDIA's H100 and H200 datasheets (half their "with sparsity" figures); the PCIe H100 first,
# as its name also holds "H100".
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12}


def transformers_seconds(module: Qwen3MoeExperts, implementation: str, x: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, repeats: int) -> dict:
    """transformers' experts forward with ``implementation``, eager, after two warm-up calls;
    its time and its largest difference from hf_paged's output."""
    module.config._experts_implementation = implementation
    with torch.no_grad():
        want = module(x, ids, weights)
        module(x, ids, weights)
        seconds = event_seconds(lambda: module(x, ids, weights), repeats)
    got = moe_experts(x, module.gate_up_proj, module.down_proj, weights, ids)
    return {"us": round(seconds * 1e6, 2),
            "max_abs_diff_from_hf_paged": (got.float() - want.float()).abs().max().item()}


def fp8_experts(module: Qwen3MoeExperts) -> tuple[torch.Tensor, BlockScales, torch.Tensor,
                                                  BlockScales]:
    """The module's experts quantized as transformers quantizes a checkpoint."""
    quantize = Fp8Quantize(argparse.Namespace(quantization_config=FineGrainedFP8Config()))
    out = []
    for name, rows in (("gate_up_proj", [INTER, INTER]), ("down_proj", [HIDDEN])):
        parts = quantize.convert({name: getattr(module, name).data})
        grid = grid_rows(rows, 128, module.gate_up_proj.device)
        out += [parts[name], BlockScales(parts[f"{name}_scale_inv"], grid, 128)]
    return tuple(out)


def measure_fp8(x: torch.Tensor, fp8: tuple, weights: torch.Tensor, ids: torch.Tensor,
                bandwidth: float, bf16_us: float, args: argparse.Namespace) -> dict:
    """The kernels on the FP8 experts: time, bytes (a byte a weight and the hit experts'
    scale grids), and the largest difference from the bf16 kernels on the dequantized
    weights' reference."""
    w13, s13, w2, s2 = fp8
    seconds = graph_seconds(partial(moe_experts, x, w13, w2, weights, ids, w13_scales=s13,
                                    w2_scales=s2), args.repeats)
    hit = ids.unique().numel()
    nbytes = (hit * (w13[0].numel() + w2[0].numel() + 4 * (s13.inv[0].numel()
                                                         + s2.inv[0].numel()))
              + 2 * x.shape[0] * HIDDEN * 2)
    tokens = x.shape[0]
    config = moe_config(tokens, EXPERTS, TOP_K, INTER, HIDDEN, DTYPE, fp8=True)
    return {"config": dataclasses.asdict(config), "kernel_us": round(seconds * 1e6, 2),
            "bytes": nbytes,
            "fraction_of_copy_bandwidth": round(nbytes / seconds / bandwidth, 3),
            "speedup_over_bf16": round(bf16_us / (seconds * 1e6), 2)}


def measure(module: Qwen3MoeExperts, fp8: tuple, phase: str, tokens: int, bandwidth: float,
            peak: float | None, args: argparse.Namespace) -> dict:
    """One batch: hf_paged's kernels from a CUDA graph, on bf16 and FP8 experts, then
    transformers' two forwards."""
    w13, w2 = module.gate_up_proj.data, module.down_proj.data
    x = torch.randn(tokens, HIDDEN, device=w13.device, dtype=DTYPE)
    logits = torch.randn(tokens, EXPERTS, device=w13.device, dtype=DTYPE)
    weights, ids = moe_route(logits, TOP_K, True)
    seconds = graph_seconds(lambda: moe_experts(x, w13, w2, weights, ids), args.repeats)
    hit = ids.unique().numel()
    nbytes = hit * (w13[0].numel() + w2[0].numel()) * 2 + 2 * tokens * HIDDEN * 2
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    row = {"phase": phase, "tokens": tokens, "experts_hit": hit,
           "config": dataclasses.asdict(moe_config(tokens, EXPERTS, TOP_K, INTER, HIDDEN, DTYPE)),
           "kernel_us": round(seconds * 1e6, 2), "bytes": nbytes,
           "achieved_bytes_per_s": nbytes / seconds,
           "fraction_of_copy_bandwidth": round(nbytes / seconds / bandwidth, 3),
           "tflops": round(flops / seconds / 1e12, 1)}
    if phase == "prefill" and peak:
        row["fraction_of_peak_flops"] = round(flops / seconds / peak, 3)
    print(f"{phase} {tokens} tokens ({hit} experts hit): {seconds * 1e6:.1f} us, "
          f"{nbytes / seconds / 1e9:.0f} GB/s ({row['fraction_of_copy_bandwidth']:.1%} of "
          f"copy), {row['tflops']} TFLOP/s", flush=True)
    row["fp8"] = measure_fp8(x, fp8, weights, ids, bandwidth, row["kernel_us"], args)
    print(f"  fp8: {row['fp8']['kernel_us']:.1f} us ({row['fp8']['fraction_of_copy_bandwidth']:.1%}"
          f" of copy, x{row['fp8']['speedup_over_bf16']} over bf16)", flush=True)
    for implementation in ("eager", "grouped_mm"):
        name = f"transformers_{implementation}"
        row[name] = guarded(name, lambda impl=implementation: transformers_seconds(
            module, impl, x, weights, ids.long(), args.baseline_repeats))
        if "us" in row[name]:
            row[name]["speedup"] = round(row[name]["us"] / row["kernel_us"], 2)
            print(f"  {name}: {row[name]['us']:.1f} us (x{row[name]['speedup']})", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 4, 16, 64, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--baseline-repeats", type=int, default=10)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = measure_copy_bandwidth(device)
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in device_name(device)), None)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    module = Qwen3MoeExperts(config).to(device=device, dtype=DTYPE)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=HIDDEN**-0.5)
        module.down_proj.normal_(std=INTER**-0.5)
    fp8 = fp8_experts(module)
    info = device_info(device)
    result = {
        "workload": "moe-kernels", "git_commit": git_commit(), "device": info,
        "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN,
                  "intermediate": INTER, "dtype": "bfloat16"},
        "bytes_model": "weights of the experts hit (counted from the routing) + tokens in "
                       "and out; the intermediate activations are left out",
        "copy_bandwidth_bytes_per_s": bandwidth, "peak_bf16_flops": peak, "rows": [],
    }
    path = args.results_dir / f"moe-kernels-{info['slug']}.json"
    phases = [("decode", t) for t in args.decode] + [("prefill", t) for t in args.prefill]
    for phase, tokens in phases:
        result["rows"].append(measure(module, fp8, phase, tokens, bandwidth, peak, args))
        write_result(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
