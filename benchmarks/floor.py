"""The memory-traffic floor: the bytes a workload's decode steps must read (weights and KV
cache) over the device's bandwidth, the lower bound every throughput and latency figure is
set against. A mixture of experts reads only the experts its tokens route to, so its weight
bytes depend on each step's batch."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from benchmarks.common import device_name, timed
from benchmarks.workloads import Workload
from hf_paged.modeling.gated_deltanet import GatedDeltaNetShape

# Peak HBM bandwidth used for the floor, by a substring of the device name.
PEAK_BANDWIDTH = {"H200": 4.3e12, "H100": 3.0e12}

FLOOR_MODEL = (
    "floor_s = bytes / bandwidth, bytes = S*W + sum_i (o_i*p_i + o_i*(o_i-1)/2) * K, where all "
    "requests run concurrently, so each of the S = max_i o_i decode steps reads the weights once; "
    "W = weight bytes read per step (every weight once, the embedding only as the LM head); "
    "K = KV-cache bytes per token (2 * layers * kv_heads * head_dim * dtype size); p_i, o_i = "
    "prompt and output lengths of request i, whose step t reads the KV of p_i + t - 1 tokens. "
    "With prefix caching, the C tokens that begin every prompt sit in one copy, read once a "
    "step: C*K*S bytes instead of C*K*sum_i o_i. Weights stored in float8 (fine-grained FP8) "
    "count one byte each and their float32 scale grids four, and K the KV cache's own dtype "
    "(one byte for an FP8 cache). Prefill compute, activations and KV writes are left out: it "
    "is a lower bound."
)
# Appended to FLOOR_MODEL for a mixture-of-experts checkpoint.
MOE_FLOOR_MODEL = (
    "Mixture of experts: a step reads the dense weights D (attention, router, norms, LM head, "
    "dense MLP layers) and, in each of the L sparse layers, only the experts its tokens route "
    "to, so W depends on the step's batch b_s (the requests still generating at step s: "
    "#{i: o_i >= s}) and S*W becomes sum_s W(b_s), W(b) = D + L * E * (1 - (1 - k/E)^b) * X, "
    "with E experts a layer, k of them per token and X bytes an expert (gate + up + down): "
    "E * (1 - (1 - k/E)^b) is the expected number of distinct experts that b tokens touch when "
    "each routes to k of the E uniformly (k at b = 1, near E at large b). A random checkpoint's "
    "router routes near-uniformly; a trained one's skew touches fewer, so for it this is an "
    "estimate rather than a bound."
)
# Appended to FLOOR_MODEL for a hybrid checkpoint (Gated DeltaNet layers beside attention).
HYBRID_FLOOR_MODEL = (
    "Hybrid model: only the full-attention layers keep a KV cache, so K counts those layers; "
    "each linear-attention (Gated DeltaNet) layer keeps a state per sequence instead, which "
    "every decode step of a request reads and writes back whole: sum_i o_i * 2 * R more bytes, "
    "R = the linear layers' state bytes of one sequence as the engine stores them (the "
    "recurrent state value_heads * key_dim * value_dim in float32 and the convolution's "
    "channels * kernel in the served dtype, each layer). Prefix caching does not share it: "
    "a sequence resumed from a snapshot has a state of its own."
)
# Appended to FLOOR_MODEL for requests on LoRA adapters.
LORA_FLOOR_MODEL = (
    "LoRA adapters: a decode step also reads, once, each distinct adapter among the requests "
    "still generating (its lora_A and lora_B of every adapted projection, in the served dtype): "
    "S*W grows by sum_s A * n_s, A = one adapter's bytes, n_s = #{adapter(i): o_i >= s}, with "
    "request i on adapter i mod N when N adapters serve a workload round-robin. The adapters' "
    "products (computed unmerged) are left out, as prefill is."
)
# Every tensor of one sparse layer's experts, whichever layout (per expert or fused [E, ...]).
_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.")
# The scale grids of block-quantized weights (``weight_scale_inv``, fused experts'
# ``gate_up_proj_scale_inv``): float32, read as stored.
_SCALE = re.compile(r"_scale_inv$")


def _served_size(name: str, stored: str, size: int) -> int:
    """Bytes an element of tensor ``name`` (safetensors dtype ``stored``) takes when served
    with other tensors in a dtype of ``size`` bytes: float8 weights stay one byte, their scale
    grids four."""
    if stored.startswith("F8"):
        return 1
    return 4 if _SCALE.search(name) else size


@dataclass(frozen=True)
class Experts:
    """The expert weights of a mixture of experts, read as far as a step's tokens route."""

    sparse_layers: int
    experts: int  # per sparse layer
    top_k: int  # experts per token
    bytes_per_expert: int  # gate + up + down of one expert

    @property
    def total_bytes(self) -> int:
        return self.sparse_layers * self.experts * self.bytes_per_expert

    def bytes_at(self, batch: int) -> float:
        """Expected expert bytes a step of ``batch`` tokens reads under uniform routing: each
        expert is missed by one token with probability ``1 - k/E``, by all with its ``batch``-th
        power. Random weights route near-uniformly; a trained router's skew touches fewer."""
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)
        return self.sparse_layers * touched * self.bytes_per_expert


@dataclass(frozen=True)
class MemoryCost:
    """Bytes one decode step must read: the dense weights (every weight of a dense checkpoint),
    the experts its tokens route to (a mixture of experts), the KV cache per cached token, and
    of a hybrid model each sequence's linear-attention state, read and written."""

    dense_bytes: int
    kv_bytes_per_token: int
    experts: Experts | None = None
    state_bytes_per_seq: int = 0  # one sequence's linear-layer state, read + written a step

    @classmethod
    def from_checkpoint(cls, path: str, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto") -> MemoryCost:
        """The bytes of ``path``'s weights as they are served in ``dtype``, and of its KV cache
        (``kv_cache_dtype``: the engine option; an FP8 cache stores one byte an element).
        Weights stored in float8 (a fine-grained FP8 checkpoint) stay one byte each and their
        float32 scale grids four: both are read as stored; every other tensor in ``dtype``."""
        config = AutoConfig.from_pretrained(path)
        size = torch.empty((), dtype=dtype).element_size()
        nbytes: dict[str, int] = {}
        for file in Path(path).glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    nbytes[name] = math.prod(tensor.get_shape()) * _served_size(
                        name, tensor.get_dtype(), size)
        total = sum(nbytes.values())
        if any(name.endswith("lm_head.weight") for name in nbytes):  # untied: lookups read rows
            total -= sum(n for name, n in nbytes.items() if name.endswith("embed_tokens.weight"))
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv_size = size if kv_cache_dtype == "auto" else 1
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(range(
            config.num_hidden_layers))
        linear = types.count("linear_attention")
        kv = 2 * (len(types) - linear) * config.num_key_value_heads * head_dim * kv_size
        experts = _experts(config, nbytes, path)
        dense = total - (0 if experts is None else experts.total_bytes)
        return cls(dense_bytes=dense, kv_bytes_per_token=kv, experts=experts,
                   state_bytes_per_seq=2 * linear * _state_bytes(config, size))

    def weight_bytes(self, batch: int) -> float:
        """Weight bytes a step of ``batch`` tokens reads: all of them, for a dense checkpoint."""
        if self.experts is None:
            return self.dense_bytes
        return self.dense_bytes + self.experts.bytes_at(batch)

    def floor_bytes(self, workload: Workload, prefix_caching: bool = False) -> float:
        """Bytes read by the workload's decode steps under ``FLOOR_MODEL``:
        ``sum_s W(b_s) + sum_i (o_i*p_i + o_i*(o_i-1)/2) * K`` over the ``S = max_i o_i``
        steps, ``b_s`` the requests still generating at step ``s`` (``S*W`` for a dense
        checkpoint), where prefix caching reads the common prefix once a step instead of once
        per request."""
        outputs, steps = workload.max_new_tokens, max(workload.max_new_tokens)
        batches = Counter(sum(o >= s for o in outputs) for s in range(1, steps + 1))
        weights = sum(n * self.weight_bytes(b) for b, n in batches.items())
        kv_tokens = sum(o * len(p) + o * (o - 1) // 2 for p, o in zip(workload.prompts, outputs))
        if prefix_caching:
            kv_tokens -= workload.common_prefix_len() * (sum(outputs) - steps)
        return (weights + kv_tokens * self.kv_bytes_per_token
                + sum(outputs) * self.state_bytes_per_seq)


@dataclass(frozen=True)
class AdapterCost:
    """``cost`` plus ``num_adapters`` LoRA adapters of ``adapter_bytes`` each, request ``i``
    of a workload on adapter ``i % num_adapters`` (``LORA_FLOOR_MODEL``; none: the base
    model's cost)."""

    cost: MemoryCost
    adapter_bytes: int
    num_adapters: int

    def adapter_floor_bytes(self, workload: Workload) -> int:
        """The adapters' bytes over the workload's decode steps: at step ``s``, each distinct
        adapter of the requests still generating, once; so each adapter at steps 1 to its
        longest request's length."""
        if self.num_adapters == 0:
            return 0
        longest = [0] * self.num_adapters
        for i, o in enumerate(workload.max_new_tokens):
            longest[i % self.num_adapters] = max(longest[i % self.num_adapters], o)
        return sum(longest) * self.adapter_bytes

    def floor_bytes(self, workload: Workload, prefix_caching: bool = False) -> float:
        return (self.cost.floor_bytes(workload, prefix_caching)
                + self.adapter_floor_bytes(workload))


def _state_bytes(config: PretrainedConfig, size: int) -> int:
    """One linear-attention layer's state of one sequence, as the engine's state pools hold
    it (``GatedDeltaNetShape.state_shapes``: float32 or the served dtype of ``size`` bytes);
    0 for a model without such layers."""
    if not hasattr(config, "linear_num_value_heads"):
        return 0
    return sum(math.prod(shape) * (size if dtype is None else dtype.itemsize)
               for shape, dtype in GatedDeltaNetShape(config).state_shapes().values())


def _experts(config: PretrainedConfig, nbytes: dict[str, int], path: str) -> Experts | None:
    """The experts of a Qwen3-MoE checkpoint whose tensors are read as ``nbytes`` bytes, None
    for a dense one. A layer is sparse as transformers builds it (not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th); the checkpoint's expert
    tensors, in either layout, must sit in exactly those layers, an equal share for each
    expert, or the floor would count them wrong."""
    num_experts = getattr(config, "num_experts", 0) or 0
    sparse = [
        i for i in range(config.num_hidden_layers)
        if num_experts and i not in (getattr(config, "mlp_only_layers", None) or [])
        and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    ]
    per_layer: dict[int, int] = defaultdict(int)
    for name, n in nbytes.items():
        if match := _EXPERT_TENSOR.search(name):
            per_layer[int(match[1])] += n
    sizes = set(per_layer.values())
    if sorted(per_layer) != sparse or len(sizes) > 1 or any(n % num_experts for n in sizes):
        raise ValueError(
            f"{path}: expert tensors in layers {sorted(per_layer)} of sizes {sorted(sizes)}, "
            f"where the config makes layers {sparse} sparse with {num_experts} experts each"
        )
    if not sparse:
        return None
    return Experts(sparse_layers=len(sparse), experts=num_experts,
                   top_k=config.num_experts_per_tok,
                   bytes_per_expert=sizes.pop() // num_experts)


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes per second moved by a large device-to-device copy (read + write)."""
    nbytes = 512 * 2**20 if device.type == "cuda" else 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, seconds = timed(lambda: [dst.copy_(src) for _ in range(10)], device)
    return 2 * nbytes * 10 / seconds


def floor_settings(device: torch.device, given: float | None, cost: MemoryCost) -> dict[str, Any]:
    """The bandwidth the floor uses (given, else by device name, else the measured copy
    bandwidth) and the model of the floor, for the result JSON."""
    measured = measure_copy_bandwidth(device)
    name = device_name(device)
    by_name = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    if given is not None:
        bandwidth, source = given, "given (--bandwidth)"
    elif by_name is not None:
        bandwidth, source = by_name, "peak for the device name"
    else:
        bandwidth, source = measured, "measured copy bandwidth"
    if cost.experts is None:
        weights: dict[str, Any] = {"weight_bytes_per_step": cost.dense_bytes}
    else:
        weights = {"dense_weight_bytes_per_step": cost.dense_bytes, **asdict(cost.experts)}
    if cost.state_bytes_per_seq:
        weights["state_bytes_per_sequence_step"] = cost.state_bytes_per_seq
    models = [FLOOR_MODEL, *([MOE_FLOOR_MODEL] if cost.experts else []),
              *([HYBRID_FLOOR_MODEL] if cost.state_bytes_per_seq else [])]
    return {
        "floor_model": " ".join(models),
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": source,
        "measured_copy_bandwidth_bytes_per_s": measured,
        **weights,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
    }
