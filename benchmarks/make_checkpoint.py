"""Write a random Qwen3 or Qwen3-MoE checkpoint of a real shape, unless the folder already
holds one; ``--quantize fp8``: its fine-grained FP8 copy (``benchmarks.fp8_checkpoint``), of
the checkpoint at ``--source`` when given (drawn aside first otherwise).

python -m benchmarks.make_checkpoint --shape 0.6b --out /tmp/ckpt/0.6b --dtype bfloat16
python -m benchmarks.make_checkpoint --quantize fp8 --source /tmp/ckpt/0.6b --out /tmp/ckpt/0.6b-fp8
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from benchmarks.fp8_checkpoint import quantize_checkpoint
from hf_paged.random_checkpoint import SHAPES, make_checkpoint


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
    parser.add_argument("--quantize", choices=["fp8"],
                        help="write the checkpoint's fine-grained FP8 copy instead")
    parser.add_argument("--source", type=Path,
                        help="with --quantize: the checkpoint to quantize (default: a new one)")
    args = parser.parse_args(argv)
    if has_checkpoint(args.out):
        print(f"checkpoint already in {args.out}; nothing to do")
        return
    if args.source is not None and not args.quantize:
        parser.error("--source is read only with --quantize")
    if args.source is not None and not has_checkpoint(args.source):
        parser.error(f"--source {args.source} holds no checkpoint")
    drawn = args.out.with_name(args.out.name + ".bf16") if args.quantize else args.out
    if args.source is None:
        make_checkpoint(args.shape, str(drawn), dtype=args.dtype, seed=args.seed,
                        device=args.device, layers=args.layers)
    if args.quantize:
        quantize_checkpoint(str(args.source or drawn), str(args.out), device=args.device)
        if args.source is None:
            shutil.rmtree(drawn)
    what = f"an FP8 copy of {args.source}" if args.source else f"a random {args.shape} checkpoint"
    print(f"wrote {what} ({args.quantize or args.dtype}) to {args.out}")


if __name__ == "__main__":
    main()
