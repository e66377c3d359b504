"""A fine-grained FP8 copy of a checkpoint folder, laid out as Qwen publishes its ``-FP8`` ones
(W8's checkpoints: the same weights as the bf16 checkpoint beside it): the folder's other files
copied, its weight files rewritten one at a time by ``hf_paged.random_checkpoint.quantize_fp8``
(what ``hf-paged make-checkpoint --quantize fp8`` writes: every projection transformers converts
in float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128 block, the rest as it was, a
``quantization_config``).

python -m benchmarks.fp8_checkpoint --source /tmp/ckpt/8b --out /tmp/ckpt/8b-fp8
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig

from hf_paged.random_checkpoint import quantize_fp8


def quantize_checkpoint(src: str, dst: str, device: str = "cpu") -> str:
    """``src`` in the FP8 layout in ``dst`` (quantized on ``device``): the disk holds the
    float weights once, beside their FP8 copy."""
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    quantize_fp8(dst, AutoConfig.from_pretrained(dst), device=device, source=src)
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the checkpoint to copy")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the copy to")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the weights are quantized")
    args = parser.parse_args(argv)
    if not (args.source / "config.json").is_file():
        parser.error(f"--source {args.source} holds no config.json")
    print(f"wrote {quantize_checkpoint(str(args.source), str(args.out), args.device)}")


if __name__ == "__main__":
    main()
