"""The test suite. Without CUDA, Triton can only interpret: the switch is made here, before any
conftest or test module imports transformers (whose torch._dynamo imports Triton) or a kernel
module, so every ``@triton.jit`` function made is an interpreted one, whichever file is
collected first (the kernel tests run them on CPU tensors); and the interpreter is sped up
(``tests/triton_interpreter.py``).

Under pytest-xdist each worker takes its share of the cores for torch's threads (and its
tests' subprocesses'), not all of them: with a thread per core in every worker the threads
oversubscribe the cores, and torch's small operations on the tiny models crawl (on two cores
the engine's decode steps were ten to a hundred times slower, once a worker had run the
interpreter)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests import triton_interpreter

    triton_interpreter.install()

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
