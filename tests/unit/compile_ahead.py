"""Runs a tiny engine's warm-up steps inside ``compiling_only`` on CPU tensors, with Triton
pointed at an H100 (sm_90) that is not there: every kernel variant the steps launch compiles
for real, ahead of time, and none runs (there is no device to run it on). Prints, as JSON, the
variants compiled per kernel and the seconds taken. argv: checkpoint, worker threads.

Run in its own process: Triton's active driver is replaced, and the kernel modules must be
imported without ``TRITON_INTERPRET``."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["HF_PAGED_TRITON_ON_CPU"] = "1"
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime import driver  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.engine import engine as engine_module  # noqa: E402
from hf_paged.kernels import launch  # noqa: E402


class AbsentH100(CudaDriver):
    """Compiles for sm_90; there is no device, so launching anything fails."""

    def __init__(self):
        pass

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    checkpoint, workers = sys.argv[1], int(sys.argv[2])
    # The Triton attention on CPU tensors too (the engine refuses it off CUDA).
    engine_module.resolve_backend = lambda backend, device, block_size: "triton"
    engine = hf_paged.from_pretrained(checkpoint, device="cpu", dtype=torch.bfloat16,
                                      attention_backend="triton", block_size=16)
    driver.set_active(AbsentH100())
    start = time.perf_counter()
    with torch.inference_mode(), launch.compiling_only(workers):
        engine.runner._warm_steps(decode=True)
    seconds = time.perf_counter() - start
    kernels = {}
    for module in sys.modules.values():
        if module is None or not getattr(module, "__name__", "").startswith("hf_paged.kernels"):
            continue
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if name.startswith("_") and name.endswith("_kernel") and caches is not None:
                compiled = caches[0][0].values() if 0 in caches else []
                kernels[name] = [type(k).__name__ for k in compiled]
    print(json.dumps({"seconds": seconds, "kernels": kernels}))
    engine.close()


if __name__ == "__main__":
    main()
