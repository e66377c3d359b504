"""The prefill graphs' padded inputs, on CPU: every step that fits a bucket runs
``PrefillGraphs.step`` over the padded buffer, recomputed eagerly where a GPU replays the
captured graph, and the tokens equal stock transformers' (float32), through chunked prefill,
the prefix cache, decode rows beside prefill chunks, and batches too large for a graph."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.worker.prefill_graphs import PrefillGraphs, token_buckets
from tests.conftest import TINY_CONFIGS, left_padded


class EagerReplay:
    """A captured graph's stand-in: a replay recomputes the step into the captured output."""

    def __init__(self, graphs: PrefillGraphs, bucket: int):
        self.graphs, self.bucket, self.replays = graphs, bucket, 0
        graphs.clear(bucket)
        self.out = graphs.step(bucket)

    def replay(self) -> None:
        self.out.copy_(self.graphs.step(self.bucket))
        self.replays += 1


def with_eager_prefill_graphs(engine, max_tokens: int, max_seqs: int) -> list[EagerReplay]:
    graphs = PrefillGraphs(engine.runner, max_tokens, max_seqs)
    with torch.inference_mode():
        stand_ins = [EagerReplay(graphs, bucket) for bucket in graphs.buckets]
    graphs.graphs = {s.bucket: (s, s.out) for s in stand_ins}
    engine.runner.prefill_graphs = graphs
    return stand_ins


def test_buckets_double_up_to_the_token_budget():
    assert token_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(100) == [32, 64, 100]
    assert token_buckets(16) == [16]


@pytest.mark.parametrize(("name", "lengths", "options", "max_tokens", "max_seqs"), [
    # Mixed lengths around the blocks' edges, the whole batch in one graph, then decode
    # batches in graphs too (the general attention kernel serves one-token rows).
    ("gqa_tied", [1, 7, 8, 9, 17, 40], {}, 128, 8),
    # A 40-token budget: steps of two sequences replay, those of more run eagerly.
    ("mha_untied", [20, 25, 30, 35, 3], dict(max_num_batched_tokens=40), 64, 2),
    # A 16-token budget: a 70-token prompt in chunks beside decode rows, twice (the second
    # time from the prefix cache), in the one 16-token bucket.
    ("gqa4_untied", [70, 64, 9], dict(max_num_batched_tokens=16), 16, 8),
])
def test_padded_graph_inputs_give_transformers_tokens(checkpoints, hf_models, name, lengths,
                                                      options, max_tokens, max_seqs):
    ids, mask = left_padded(lengths, TINY_CONFIGS[name]["vocab_size"], seed=4)
    ref = hf_models[name].generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    engine = hf_paged.from_pretrained(checkpoints[name], block_size=8, **options)
    stand_ins = with_eager_prefill_graphs(engine, max_tokens, max_seqs)
    for _ in range(2):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10), ref)
    assert sum(s.replays for s in stand_ins) > 0
