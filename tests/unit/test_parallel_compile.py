"""Start-up's compile-only pass on CPU: a tiny engine's warm-up steps inside
``compiling_only``, with Triton compiling for an sm_90 GPU that is not there
(``compile_ahead.py``, in its own process), leave every kernel they launch compiled for real
and run none of them."""

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


def test_the_warm_up_steps_compile_every_kernel_they_launch(checkpoints, tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "tests.unit.compile_ahead",
                           checkpoints["gqa4_untied"], "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = json.loads(proc.stdout.splitlines()[-1])["kernels"]
    launched = {name for name, compiled in kernels.items() if compiled}
    assert {"_attention_kernel", "_shared_prefix_kernel", "_combine_splits_kernel",
            "_rms_norm_kernel", "_norm_rope_store_kernel", "_silu_and_mul_kernel",
            "_sample_kernel"} <= launched
    assert all(kind == "CompiledKernel" for compiled in kernels.values() for kind in compiled)
