"""Stock transformers' FP8 path on a machine without the Hugging Face hub.

transformers runs fine-grained FP8 checkpoints on a GPU with the Triton kernels of the hub
repository ``kernels-community/finegrained-fp8``, which it downloads through the ``kernels``
package on first use. Where the hub is out of reach, ``register(path)`` imports that
repository's Python package from a local copy (its ``torch-ext/finegrained_fp8`` folder, with
the ``_ops.py`` the kernel builder would generate) and hands its entry points to transformers'
own holder of the loaded kernel (``FineGrainedFP8``), exactly where a hub download would land,
so stock ``from_pretrained`` / ``generate`` run their real FP8 kernels. Without it, stock
transformers cannot run FP8 on the GPU, and the benchmarks fall back to its ``dequantize=True``
path (bf16 weights), saying so in the result.
"""

from __future__ import annotations

import importlib
import os
import sys


def register(path: str | None) -> None:
    """Make ``path`` (a folder holding the ``finegrained_fp8`` package, or the package folder
    itself) the kernel stock transformers loads for FP8; None leaves transformers' own loading."""
    if not path:
        return
    folder = os.path.abspath(path)
    if os.path.basename(folder) == "finegrained_fp8":
        folder = os.path.dirname(folder)
    if not os.path.isdir(os.path.join(folder, "finegrained_fp8")):
        raise FileNotFoundError(f"--stock-fp8-kernel: no finegrained_fp8 package in {path}")
    sys.path.insert(0, folder)
    module = importlib.import_module("finegrained_fp8")
    from transformers.integrations import finegrained_fp8 as stock

    stock._FINEGRAINED_FP8 = stock.FineGrainedFP8(
        matmul=module.matmul_2d, batched_matmul=module.matmul_batched,
        grouped_matmul=module.matmul_grouped)
