"""transformers' Qwen3 skeleton, built on the meta device, with hf_paged's modules swapped in.

The module tree and parameter paths stay transformers' own (``model.layers.3.self_attn...``);
only the merged projections differ (``qkv_proj`` holds q/k/v, ``gate_up_proj`` gate/up), and
the loader maps checkpoint names onto them. transformers' forward, masks and cache objects
are not used: ``PagedQwen3.forward`` drives the swapped modules with paged metadata.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_paged.modeling.attention import AttentionMetadata, Qwen3PagedAttention
from hf_paged.modeling.embedding import ParallelLMHead, VocabParallelEmbedding
from hf_paged.modeling.loader import (
    Checkpoint,
    ExpectedKeys,
    load_weights,
    match_keys,
    ties_embeddings,
)
from hf_paged.modeling.mlp import Qwen3PagedMLP
from hf_paged.modeling.norm import RMSNorm
from hf_paged.modeling.rotary import RotaryEmbedding
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout

SUPPORTED = "Qwen3 checkpoints (model_type 'qwen3', Qwen3ForCausalLM)"


def check_supported(config) -> None:
    if getattr(config, "model_type", None) != "qwen3":
        raise ValueError(
            f"hf_paged supports {SUPPORTED}; this checkpoint has model_type "
            f"{getattr(config, 'model_type', None)!r}"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("sliding-window attention layers are not supported by hf_paged")


def check_shardable(config, tp_size: int) -> None:
    """Raise ValueError, naming both numbers, when ``tp_size`` ranks cannot split the model."""
    kv_head_layout(config.num_attention_heads, config.num_key_value_heads, tp_size)
    if config.intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({config.intermediate_size}) is not divisible by "
            f"tensor_parallel_size ({tp_size})"
        )


class PagedQwen3:
    """The swapped transformers model plus the forward that drives it on paged metadata."""

    def __init__(self, hf_model: Qwen3ForCausalLM):
        self.hf_model = hf_model
        self.config: Qwen3Config = hf_model.config
        inner = hf_model.model
        self.embed_tokens, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head

    @property
    def attention_layers(self) -> list[Qwen3PagedAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:  # each block norms its input (fused into its projection)
            hidden, residual = layer.self_attn(positions, hidden, residual,
                                               layer.input_layernorm, meta, self.rotary)
            hidden, residual = layer.mlp(hidden, residual, layer.post_attention_layernorm)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model dtype, then float32, as transformers' generate reads them; under
        tensor parallelism on rank 0 only (None on the others)."""
        return self.gather_logits(self.lm_head(hidden))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's vocabulary slice of the logits -> full float32 logits on rank 0."""
        logits = self.lm_head.gather(local_logits)
        return None if logits is None else logits.float()


def build_model(
    config: Qwen3Config,
    checkpoint: str,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    max_positions: int,
    tp: TensorParallel = SINGLE,
) -> PagedQwen3:
    """Skeleton on meta -> swap -> check the checkpoint's keys -> allocate on ``device`` ->
    load this rank's weights."""
    check_supported(config)
    check_shardable(config, tp.size)
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(config)
        expected = ExpectedKeys.of(hf)  # transformers' names and full shapes, before the swap
        inner = hf.model
        eps = config.rms_norm_eps
        for layer in inner.layers:
            layer.self_attn = Qwen3PagedAttention(config, attention_backend, tp)
            layer.mlp = Qwen3PagedMLP(config, tp)
            layer.input_layernorm = RMSNorm(config.hidden_size, eps)
            layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        inner.norm = RMSNorm(config.hidden_size, eps)
        inner.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        inner.rotary_emb = RotaryEmbedding(inner.rotary_emb, max_positions)
        hf.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
    # Every rank checks (and fails alike); rank 0 alone logs.
    weights = Checkpoint.open(checkpoint)
    tied = ties_embeddings(weights, bool(getattr(config, "tie_word_embeddings", False)),
                           log=tp.rank == 0)
    sources = match_keys(weights, expected, tied, log=tp.rank == 0)
    if tied:
        del hf.lm_head.weight
    hf.to(dtype).to_empty(device=device).eval()
    if tied:
        hf.lm_head.weight = inner.embed_tokens.weight
    inner.rotary_emb.build_cache(device)
    load_weights(hf, weights, sources)
    return PagedQwen3(hf)
