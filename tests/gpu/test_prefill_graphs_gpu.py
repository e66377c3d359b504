"""Prefill CUDA graphs on the GPU: float32 tokens equal stock transformers' (run on CPU) for
lone prompts of lengths around the buckets' edges and for a mixed batch, and the graphs are
the ones replayed."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

import hf_paged
from hf_paged.random_checkpoint import random_qwen3
from tests.conftest import TINY_CONFIGS, left_padded

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NAME = "gqa4_untied"


class CountedGraph:
    """A CUDA graph that counts its replays (and passes the rest, e.g. ``reset``, through)."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def __getattr__(self, name: str):
        return getattr(self.graph, name)

    def replay(self) -> None:
        self.graph.replay()
        self.replays += 1


def test_prefill_graphs_replay_and_match_transformers(tmp_path):
    model = random_qwen3(Qwen3Config(**TINY_CONFIGS[NAME], dtype="float32"), seed=0).eval()
    model.save_pretrained(tmp_path)
    engine = hf_paged.from_pretrained(str(tmp_path), device="cuda", block_size=16,
                                      gpu_memory_utilization=0.3)
    graphs = engine.executor.runner.prefill_graphs
    assert sorted(graphs.graphs) == [(b, False) for b in graphs.buckets]  # no adapters
    counted = {b: CountedGraph(g) for (b, _), (g, _) in graphs.graphs.items()}
    graphs.graphs = {(b, False): (counted[b], out) for (b, _), (_, out) in graphs.graphs.items()}
    vocab = TINY_CONFIGS[NAME]["vocab_size"]
    cases = [[n] for n in (1, 31, 32, 33, 200, 1000)] + [[5, 40, 100, 7]]
    for seed, lengths in enumerate(cases):
        ids, mask = left_padded(lengths, vocab, seed=seed)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=12)
        assert torch.equal(out.cpu(), ref), lengths
    assert counted[32].replays and counted[64].replays and counted[1024].replays
    engine.close()
