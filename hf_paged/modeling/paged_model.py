"""transformers' causal LM with hf_paged's modules swapped in, and the forward that drives them
on paged metadata.

The module tree and parameter paths stay transformers' own (``model.layers.3.self_attn...``);
only a family's merged projections differ (Qwen3's ``qkv_proj`` holds q/k/v), and the loader
maps checkpoint names onto them. transformers' forward, masks and cache objects are not used.

What a family's swap must leave (``hf_paged.families``): ``model.embed_tokens`` (token ids ->
hidden states), ``model.layers`` whose ``self_attn(positions, hidden, residual, norm, meta,
rotary)`` and ``mlp(hidden, residual, norm)`` each return the block's output and the new
residual stream, norming their input with the layer's ``input_layernorm`` /
``post_attention_layernorm`` (``self_attn`` also holds the layer's ``k_cache`` / ``v_cache``
and an FP8 cache's ``k_scale`` / ``v_scale``, and takes a checkpoint's in ``set_kv_scales``);
``model.norm(hidden, residual)``, ``model.rotary_emb`` (a ``RotaryEmbedding``) and
``lm_head`` (a ``ParallelLMHead``). A hybrid model's linear-attention layers have
``linear_attn(hidden, residual, norm, meta)`` in place of ``self_attn``, holding that layer's
state pools (``conv_state``, ``recurrent_state``; ``modeling.gated_deltanet``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from hf_paged.modeling.attention import AttentionMetadata


class PagedModel:
    """The swapped transformers model plus the forward that drives it on paged metadata."""

    def __init__(self, hf_model: PreTrainedModel):
        self.hf_model = hf_model
        self.config: PretrainedConfig = hf_model.config
        inner = hf_model.model
        self.embed_tokens, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head

    @property
    def attention_layers(self) -> list[nn.Module]:
        """Each full-attention layer's attention module, which holds that layer's
        ``k_cache``/``v_cache`` (a hybrid model's linear-attention layers have none)."""
        return [layer.self_attn for layer in self.layers if hasattr(layer, "self_attn")]

    @property
    def state_modules(self) -> list[nn.Module]:
        """A hybrid model's linear-attention modules (``linear_attn``), in layer order, which
        hold that layer's state pools (``worker.state_cache``); empty for other models."""
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
        streams: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states; ``pending``: ``(src, last_tokens)``, the tokens still on the
        device that replace ``input_ids`` where ``src >= 0`` (``kernels.embed``). ``streams``
        gets transformers' ``hidden_states``: the embeddings, each layer's output but the
        last, then the final (normed) hidden states."""
        hidden, residual = self.embed_tokens(input_ids, *(pending or ())), None
        for layer in self.layers:  # each block norms its input (fused into its projection)
            if streams is not None:  # the layer's input: the embeddings, then the pair's sum
                # (a copy of the embeddings: the first layer's residual, which the GPU's fused
                # residual add overwrites in place)
                streams.append(hidden.clone() if residual is None else hidden + residual)
            if hasattr(layer, "linear_attn"):
                hidden, residual = layer.linear_attn(hidden, residual, layer.input_layernorm,
                                                     meta)
            else:
                hidden, residual = layer.self_attn(positions, hidden, residual,
                                                   layer.input_layernorm, meta, self.rotary)
            hidden, residual = layer.mlp(hidden, residual, layer.post_attention_layernorm)
        final = self.norm(hidden, residual)[0]
        if streams is not None:
            streams.append(final)
        return final

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model dtype, then float32, as transformers' generate reads them; under
        tensor parallelism on rank 0 only (None on the others)."""
        return self.gather_logits(self.lm_head(hidden))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's vocabulary slice of the logits -> full float32 logits on rank 0."""
        logits = self.lm_head.gather(local_logits)
        return None if logits is None else logits.float()
