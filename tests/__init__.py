"""The test suite. Without CUDA, Triton can only interpret: the switch is made here, before any
conftest or test module imports transformers (whose torch._dynamo imports Triton) or a kernel
module, so every ``@triton.jit`` function made is an interpreted one, whichever file is
collected first (the kernel tests run them on CPU tensors); and the interpreter is sped up
(``tests/triton_interpreter.py``)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests import triton_interpreter

    triton_interpreter.install()
