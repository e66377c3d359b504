"""Start-up's compile-only pass on CPU (``benchmarks/count_variants.py``, in its own process):
a tiny engine's warm-up steps and every graph's step (with LoRA stacks, those adding adapter
deltas too), inside ``compiling_only`` with Triton compiling for an sm_90 GPU that is not
there, leave every kernel they launch compiled for real and run none of them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("triton.runtime._async_compile") is None,
    reason="needs Triton with asynchronous compilation")


@pytest.mark.parametrize("lora", [False, True], ids=["base", "enable_lora"])
def test_start_up_compiles_every_kernel_variant_it_launches(checkpoints, tmp_path, lora):
    """With ``enable_lora`` the graphs adding adapter deltas too: the LoRA kernels' decode
    and prefill variants (plain, normed, gated)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.count_variants", "--model",
                           checkpoints["gqa4_untied"], "--workers", "2", "--max-num-seqs", "16",
                           "--max-num-batched-tokens", "64", *["--enable-lora"] * lora],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = json.loads(proc.stdout)["kernels"]
    assert {"_attention_kernel", "shared_prefix_kernel", "combine_splits_kernel",
            "_rms_norm_kernel", "_norm_rope_store_kernel", "_silu_and_mul_kernel",
            "_sample_kernel"} <= set(kernels)
    if lora:  # decode and prefill tiles; q/k/v, o and down, gate/up
        assert len(kernels["_shrink_kernel"]) == len(kernels["_expand_kernel"]) == 6
    assert not [v for found in kernels.values() for v in found if v.startswith("not compiled")]
