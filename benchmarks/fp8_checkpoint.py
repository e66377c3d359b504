"""A fine-grained FP8 copy of a checkpoint folder, laid out as Qwen publishes its ``-FP8`` ones
(W8's checkpoints: the same weights as the bf16 checkpoint beside it): every
attention and MLP projection (each expert's too) float8_e4m3fn with a float32
``weight_scale_inv`` per 128x128 block, quantized with transformers' own ``Fp8Quantize``; the
embedding, the LM head, the norms and the routers as they were; a ``quantization_config``
naming what stays unquantized.

A dimension that is not a multiple of 128 is quantized as zero-padded to one (the last block
cut short: its scale covers the values it holds), which transformers' ``Fp8Quantize`` leaves
alone.

python -m benchmarks.fp8_checkpoint --source /tmp/ckpt/8b --out /tmp/ckpt/8b-fp8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

BLOCK = 128
_PROJECTION = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
_ROUTER = re.compile(r"^(.*\.mlp\.gate)\.weight$")


def quantize_weight(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``name`` in float8_e4m3fn and its ``weight_scale_inv`` grid, as transformers quantizes
    a checkpoint on load."""
    rows, cols = weight.shape
    padded = F.pad(weight, (0, -cols % BLOCK, 0, -rows % BLOCK))
    quantize = Fp8Quantize(argparse.Namespace(quantization_config=FineGrainedFP8Config()))
    out = quantize.convert({name: padded})
    out[name] = out[name][:rows, :cols].contiguous()
    return out


def quantize_checkpoint(src: str, dst: str, device: str = "cpu") -> str:
    """Write ``src`` (a folder as ``make_checkpoint`` writes it) with its projections in FP8
    to ``dst``, the tokenizer and generation config copied; quantized on ``device``."""
    src_dir, dst_dir = Path(src), Path(dst)
    dst_dir.mkdir(parents=True, exist_ok=True)
    keep = ["lm_head"]
    for file in sorted(src_dir.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if _PROJECTION.search(name):
                    tensors.update(quantize_weight(name, tensor))
                else:
                    tensors[name] = tensor
                    if router := _ROUTER.match(name):
                        keep.append(router[1])
        save_file({k: v.cpu() for k, v in tensors.items()}, str(dst_dir / file.name),
                  metadata={"format": "pt"})
    for other in src_dir.iterdir():
        if other.suffix != ".safetensors" and other.is_file():
            shutil.copy(other, dst_dir / other.name)
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": keep,
    }
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(dst_dir)


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
