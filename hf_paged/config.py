"""EngineConfig: every engine knob, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

ATTENTION_BACKENDS = ("triton", "sdpa", "flash_attn")
SPECULATIVE_METHODS = ("ngram", "draft")
# "auto": the model's dtype; the others: float8_e4m3fn with per-KV-head scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
MOE_PARALLEL = ("intermediate", "experts")


@dataclass
class EngineConfig:
    """Engine settings. Pass any of them to ``hf_paged.from_pretrained(..., name=value)``.

    Attributes:
        max_num_seqs: most requests that run (hold KV blocks and decode) at once.
        max_num_batched_tokens: most tokens one forward pass computes (prefill chunks plus
            decode tokens); longer prompts are prefilled in chunks of at most this size.
        max_model_len: longest sequence (prompt plus new tokens); defaults to the
            checkpoint's ``max_position_embeddings``.
        block_size: tokens per KV-cache block (a power of two, 8 to 256). Prefix caching
            shares whole blocks, so smaller blocks share shorter common prefixes; larger ones
            read faster: on an H100, W1 ran 3.4% faster at 64 than at 16 (its decode
            attention 3.3% faster over a sequence's blocks as they are allocated, one every
            ``block_size`` steps) and no faster at 128 or 256.
        gpu_memory_utilization: fraction of the GPU's memory the engine may use in all
            (weights, activations and KV cache); the KV cache takes what is left.
        num_kv_blocks: an explicit number of KV-cache blocks, overriding the sizing from memory.
        cpu_kv_cache_gib: size of the KV cache on CPU, in GiB (CPU memory is not probed).
        enforce_eager: never capture CUDA graphs (decode and small prefills run eagerly).
        max_graph_batch_size: largest decode batch captured as a CUDA graph; larger decode
            batches run eagerly. Defaults to ``min(max_num_seqs, 512)``.
        attention_backend: ``"triton"`` (CUDA default), ``"sdpa"`` (torch only; CPU default)
            or ``"flash_attn"`` (only when the flash-attn package imports; needs
            ``block_size=256``, flash-attn's page granularity).
        kv_cache_dtype: ``"auto"`` (the default: the model's dtype) or ``"fp8"`` /
            ``"fp8_e4m3"``: keys and values stored as float8_e4m3fn, one byte an element, with
            float32 scales per layer and KV head (from the checkpoint where it ships them,
            else calibrated at start-up; ``worker.kv_scales``): the cache holds twice the
            tokens and decode attention reads half the bytes, at an fp8 rounding error on
            every key and value. Not with ``attention_backend="flash_attn"``.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes across requests.
        num_state_snapshots: a hybrid model's (linear-attention layers beside full-attention
            ones) prefix caching: snapshots of those layers' state at cached block boundaries,
            each as large as a running sequence's state and allocated beside them before the
            KV cache is sized. A prefix-cache hit resumes after the last cached block with a
            snapshot; 0 (the default): such a model takes no prefix-cache hits.
        progress_bar: show a tqdm bar with prefill/decode throughput while requests run. Off
            by default: transformers' ``generate()`` prints nothing, and neither does the
            drop-in. A ``generate(..., progress_bar=True)`` call turns it on for that call.
        tensor_parallel_size: ranks the model is split across (one GPU each on CUDA). From an
            ordinary process the caller is rank 0 and the other ranks are spawned; under
            torchrun the launched processes are the ranks, in groups of this size.
        data_parallel_size: engine replicas that share the requests, each in a process of its
            own on GPUs ``[i * tensor_parallel_size, (i + 1) * tensor_parallel_size)``
            (``hf_paged.integrations.data_parallel``); from ``hf_paged.from_pretrained`` or
            ``AutoModelForCausalLM.from_pretrained``, whose ``generate`` deals each call's rows
            (a row's beams and return sequences together) to the replicas with the fewest
            outstanding tokens (prompt plus new-token budget) and returns them in order.
        moe_parallel: how tensor parallelism splits a mixture-of-experts layer's routed
            experts: ``"intermediate"`` (the default, which measured as fast at W1 and faster
            at batch 1 on the Qwen3-30B-A3B shape over two GPUs: every rank holds every
            expert's slice of ``moe_intermediate_size``) or ``"experts"`` (expert
            parallelism: each rank holds ``num_experts / tensor_parallel_size`` whole experts
            and computes only the routed pairs that reach them; the activations stay
            replicated, so the same all-reduce sums the ranks' shares). A shared expert is
            split by its intermediate size either way.
        disable_custom_all_reduce: on CUDA, reduce across ranks with NCCL alone instead of
            through symmetric memory (which serves tensors of up to 2,048 tokens' hidden
            states, at the sizes where start-up measured it faster than NCCL).
        speculative_method: speculative decoding for every request that names none in its
            ``SamplingParams``: ``"ngram"`` (prompt lookup: drafts copied from where the
            sequence's last n-gram occurred earlier in it) or ``"draft"`` (a small model of
            the same tokenizer, ``speculative_model``, drafts greedily on its own paged cache);
            None: off. Verification keeps greedy output token for token and sampled output
            distributed as plain sampling.
        speculative_model: the draft model's checkpoint (a folder or a hub id); implies
            ``speculative_method="draft"``.
        num_speculative_tokens: draft tokens proposed a step at most.
        prompt_lookup_max: longest n-gram prompt lookup matches (it tries this many trailing
            tokens first, then fewer, down to one).
        speculative_max_batch: speculation runs while at most this many requests are running;
            a larger batch decodes one token a step, since verifying drafts for it would cost
            more compute than the weight reads it saves.
        max_loras: LoRA adapters the engine holds at once (``add_lora``), each in a slot
            beside every projection; requests on any of them and on the base model share
            batches. The slots take device memory from the first adapter on (from what the KV
            cache left, unless ``enable_lora``).
        enable_lora: allocate the adapter slots at start-up, before the KV cache is sized
            (their memory counted), and capture the decode graphs with adapters then, as
            vLLM's option does; without it the first ``add_lora`` does both.
        max_lora_rank: the largest adapter rank a slot holds (smaller ranks are zero-padded).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    cpu_kv_cache_gib: float = 1.0
    enforce_eager: bool = False
    max_graph_batch_size: int | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_state_snapshots: int = 0
    progress_bar: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    moe_parallel: str = "intermediate"
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 2
    speculative_max_batch: int = 8
    max_loras: int = 4
    max_lora_rank: int = 64
    enable_lora: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "data_parallel_size", "num_speculative_tokens", "prompt_lookup_max",
                     "speculative_max_batch", "max_loras", "max_lora_rank"):
            _require_positive_int(name, getattr(self, name))
        if not isinstance(self.num_state_snapshots, int) or isinstance(
                self.num_state_snapshots, bool) or self.num_state_snapshots < 0:
            raise ValueError("num_state_snapshots must be a non-negative integer, got "
                             f"{self.num_state_snapshots!r}")
        for name in ("max_model_len", "num_kv_blocks", "max_graph_batch_size"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        bs = self.block_size
        if not isinstance(bs, int) or bs < 8 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {bs!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("disable_custom_all_reduce", "progress_bar", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib!r}")
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS} or None, "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model names the draft checkpoint: it is required with "
                             "speculative_method='draft' and only then")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS} or None, "
                f"got {self.attention_backend!r}"
            )
        if self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe_parallel must be one of {MOE_PARALLEL}, "
                             f"got {self.moe_parallel!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash_attn":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported by "
                             "attention_backend 'flash_attn' (use 'triton')")

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
