"""The Triton kernel variants an engine's start-up compiles, counted and timed without a GPU.

    python -m benchmarks.count_variants --model /tmp/ckpt/0.6b --workers 2

Builds the engine on CPU with every op sent to Triton, points Triton at an sm_90 GPU that is
not there, and runs start-up's compile-only pass (the warm-up steps, then every decode and
prefill graph's step) inside ``compiling_only``: each variant compiles for real, ahead of
time, and nothing runs. Prints JSON: per kernel, its variants' specialisations (the argument
types and Triton's "D": divisible by 16), and the seconds the pass took. A variant costs a
fresh machine its compile time at start-up, so fewer is faster. Run it as its own process:
it replaces Triton's active driver, and the kernel modules must not be interpreted.
"""

from __future__ import annotations

import argparse
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
from hf_paged.worker import executor as executor_module  # noqa: E402
from hf_paged.worker.startup import Startup  # noqa: E402


class AbsentGPU(CudaDriver):
    """Compiles for an sm_90 GPU; there is none, so launching anything fails."""

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


def variants() -> dict[str, list[str]]:
    """Each kernel's variants (their specialisations), by kernel name."""
    found: dict[str, list[str]] = {}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("hf_paged.kernels."):
            continue
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if not (name.endswith("_kernel") and caches and 0 in caches):
                continue
            for key, kernel in caches[0][0].items():
                spec = key.split("]")[0] + "]"
                compiled = type(kernel).__name__ == "CompiledKernel"
                found.setdefault(name, []).append(spec if compiled else f"not compiled: {spec}")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, default=None, help="default: this process's CPUs")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the largest decode graph")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--enable-lora", action="store_true",
                        help="LoRA stacks allocated: the graphs adding adapter deltas too")
    args = parser.parse_args(argv)
    # The Triton attention on CPU tensors too (the engine refuses it off CUDA).
    executor_module.resolve_backend = lambda backend, device, block_size: "triton"
    engine = hf_paged.from_pretrained(
        args.model, device="cpu", dtype=torch.bfloat16, attention_backend="triton",
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=512, enable_lora=args.enable_lora)
    runner = engine.executor.runner
    graphs = list(runner.new_graphs())  # those a GPU's start-up captures
    startup = Startup(runner.model, runner.kv, runner.sampler, runner.config,
                      runner.max_model_len, runner.tp, graphs, adapters=args.enable_lora)
    driver.set_active(AbsentGPU())
    start = time.perf_counter()
    startup._compile_ahead(workers=args.workers)
    seconds = time.perf_counter() - start
    engine.close()
    found = variants()
    print(json.dumps({"seconds": seconds, "variants": sum(map(len, found.values())),
                      "kernels": found}, indent=1))


if __name__ == "__main__":
    main()
