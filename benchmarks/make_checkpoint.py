"""Write a random Qwen3 or Qwen3-MoE checkpoint of a real shape, unless the folder already
holds one.

python -m benchmarks.make_checkpoint --shape 0.6b --out /tmp/ckpt/0.6b --dtype bfloat16
    [--quantize fp8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_paged.random_checkpoint import QUANTIZE, SHAPES, make_checkpoint


def has_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="0.6b")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint to")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int,
                        help="decoder layers (default: the shape's own; each layer unchanged)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the weights are drawn (default: the GPU when there is one)")
    parser.add_argument("--quantize", choices=QUANTIZE,
                        help="fp8: Qwen's fine-grained FP8 layout (128x128 blocks)")
    args = parser.parse_args(argv)
    if has_checkpoint(args.out):
        print(f"checkpoint already in {args.out}; nothing to do")
        return
    make_checkpoint(args.shape, str(args.out), dtype=args.dtype, seed=args.seed,
                    device=args.device, layers=args.layers, quantize=args.quantize)
    kind = f"{args.dtype}, {args.quantize}" if args.quantize else args.dtype
    print(f"wrote a random {args.shape} ({kind}) checkpoint to {args.out}")


if __name__ == "__main__":
    main()
