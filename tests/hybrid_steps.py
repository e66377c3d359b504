"""A hybrid model (Qwen3-Next, Qwen3.5) driven step by step without the engine: this harness
sizes the KV cache of the attention layers and the state pools of the linear-attention layers
itself (what the worker does), gives each sequence a range of blocks and a state slot, and
builds each step's ``AttentionMetadata`` from (sequence, tokens) chunks."""

from __future__ import annotations

import torch

from hf_paged import families
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.paged_model import PagedModel

BLOCK_SIZE = 8
BLOCKS_PER_SEQ = 16


class HybridSteps:
    """``model`` (one of ``tp_size`` ranks' shards) with room for ``num_seqs`` sequences of up
    to ``BLOCK_SIZE * BLOCKS_PER_SEQ`` tokens; sequence ``i`` owns state slot ``slots[i]``
    (shuffled, so that slot and batch order differ)."""

    def __init__(self, model: PagedModel, num_seqs: int, tp_size: int = 1):
        config, dtype = model.config, model.lm_head.weight.dtype
        self.model, self.lengths = model, [0] * num_seqs
        blocks = num_seqs * BLOCKS_PER_SEQ
        for attn in model.attention_layers:
            attn.k_cache = torch.zeros(blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
                                       dtype=dtype)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        shapes = families.family_for(config).state_shapes(config, tp_size)
        self.slots = torch.randperm(num_seqs + 2, generator=torch.Generator().manual_seed(0))
        for module in model.state_modules:
            for name, (shape, state_dtype) in shapes.items():
                # garbage in every slot: a sequence starting from zero must not read it
                setattr(module, name, torch.randn(num_seqs + 2, *shape,
                                                  dtype=state_dtype or dtype))

    def step(self, chunks: list[tuple[int, list[int]]], hidden: bool = False) -> torch.Tensor:
        """One forward over each (sequence, new tokens) chunk, packed in the given order;
        the logits of every row in the model dtype (``hidden``: the final hidden states)."""
        ids, positions, slot_mapping, cu, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks:
            start = self.lengths[seq]
            pos = list(range(start, start + len(tokens)))
            first_block = seq * BLOCKS_PER_SEQ
            ids += tokens
            positions += pos
            slot_mapping += [(first_block + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
                             for p in pos]
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(list(range(first_block, first_block + BLOCKS_PER_SEQ)))
        seqs = [seq for seq, _ in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping), cu_seqlens_q=torch.tensor(cu).int(),
            seq_lens=torch.tensor(seq_lens).int(), block_tables=torch.tensor(tables).int(),
            max_query_len=max(len(tokens) for _, tokens in chunks),
            state_slots=self.slots[seqs].int(),
            has_initial_state=torch.tensor([self.lengths[s] > 0 for s in seqs]),
        )
        with torch.no_grad():
            states = self.model.forward(torch.tensor(ids), torch.tensor(positions), meta)
            # one rank's vocabulary slice is the whole vocabulary; compute_logits would round
            # a float64 model's logits to float32
            out = states if hidden else self.model.lm_head.gather(self.model.lm_head(states))
        for seq, tokens in chunks:
            self.lengths[seq] += len(tokens)
        return out
