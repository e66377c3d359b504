"""LoRA adapters for the benchmarks and GPU tests: random ones saved by peft itself in its
layout, and the systems that serve them: hf_paged's engine with requests spread over several
adapters, and stock transformers + peft on one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import hf_paged
from benchmarks.systems import GenerateSystem, PagedSystem, check_lengths
from benchmarks.workloads import Workload
from hf_paged.lora.reading import read_adapter

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# lora_B's spread. lora_A is drawn as peft's default initialisation draws it (kaiming-uniform:
# ``A x`` about 0.58 times as large as ``x``), so with alpha = 2r an adapter changes a random
# checkpoint's projection output (its weights have std 1.5/sqrt(in)) by about 3%
# (2 * sqrt(16) * 0.01 * 0.58 / 1.5), as a trained adapter might; peft's
# init_lora_weights=False (lora_B drawn as lora_A is, U(+-1/sqrt(r))) would change it by 45%.
B_STD = 0.01


def make_adapters(model: str, out: str, count: int, rank: int = 16, seed: int = 0,
                  b_std: float = B_STD, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu") -> list[str]:
    """``count`` distinct rank-``rank`` adapters on all seven projections of checkpoint
    ``model``, drawn on ``device`` and saved by peft's ``save_pretrained`` in folders
    ``out/adapter<i>``, in ``dtype``. peft wraps a model built on the meta device: only the
    adapters' weights are ever allocated."""
    folders = [Path(out) / f"adapter{i}" for i in range(count)]
    config = AutoConfig.from_pretrained(model)
    config._name_or_path = model  # adapter_config.json's base_model_name_or_path
    with torch.device("meta"):
        stock = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(stock, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=PROJECTIONS,
                                                  task_type="CAUSAL_LM"))
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    gen = torch.Generator(device).manual_seed(seed)

    def draw(shape: torch.Size, fill: str, *params: float) -> torch.nn.Parameter:
        """A tensor of ``shape`` filled in place by ``fill`` (``uniform_``, ``normal_``)."""
        values = torch.empty(shape, device=device)
        getattr(values, fill)(*params, generator=gen)
        return torch.nn.Parameter(values.to(dtype))

    for folder in folders:
        for layer in layers:
            a, b = layer.lora_A["default"], layer.lora_B["default"]
            bound = 1 / math.sqrt(a.in_features)  # kaiming_uniform_(a=sqrt(5)), peft's default
            a.weight = draw(a.weight.shape, "uniform_", -bound, bound)
            b.weight = draw(b.weight.shape, "normal_", 0.0, b_std)
        peft_model.save_pretrained(str(folder))
    return [str(f) for f in folders]


def adapter_bytes(folder: str, dtype: torch.dtype) -> int:
    """Bytes of the adapter in ``folder`` (its lora_A and lora_B of every projection) when
    served in ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    with safe_open(str(Path(folder) / "adapter_model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) * size for name in f.keys())


class LoraPagedSystem(PagedSystem):
    """hf_paged with ``adapters`` (folders) loaded as ``adapter<i>``, request ``i`` of a
    workload on adapter ``i % len(adapters)`` (round-robin); none: the base model."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device,
                 adapters: list[str], sampling: dict[str, Any] | None = None, **options: Any):
        super().__init__(path, dtype, device, sampling, **options)
        self.names = [f"adapter{i}" for i in range(len(adapters))]
        for name, folder in zip(self.names, adapters):
            self.engine.add_lora(name, read_adapter(folder, name, self.engine.hf_config, dtype))

    def adapter_of(self, request: int) -> str | None:
        return self.names[request % len(self.names)] if self.names else None

    def run(self, workload: Workload) -> int:
        params = [hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True,
                                          adapter=self.adapter_of(i), **self.sampling)
                  for i, n in enumerate(workload.max_new_tokens)]
        outputs = self.engine.generate_tokens(workload.prompts, params, progress_bar=False)
        return check_lengths([len(o) for o in outputs], workload)

    def describe(self) -> dict[str, Any]:
        runner = self.engine.executor.runner
        decode, prefill = (getattr(runner, name, None)
                           for name in ("decode_graphs", "prefill_graphs"))
        return {**super().describe(), "adapters": len(self.names),
                "decode_graphs_with_adapters": bool(getattr(decode, "with_adapters", None)),
                "prefill_graphs_with_adapters": bool(getattr(prefill, "with_adapters", None))}


class PeftGenerateSystem(GenerateSystem):
    """Stock transformers' ``generate`` under peft's LoRA adapter in ``adapter`` (peft's
    layers unmerged, as peft serves an adapter it may switch)."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, adapter: str,
                 **system: Any):
        super().__init__(path, dtype, device, **system)
        self.model = PeftModel.from_pretrained(self.model, adapter).eval()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "peft_merged": False}

