"""The CUDA graphs' padded inputs, on CPU: every step that fits a graph runs its ``step`` over
the padded buffer, recomputed eagerly where a GPU replays the captured graph, and the tokens
equal stock transformers' (float32). Prefill graphs: through chunked prefill, the prefix cache,
decode rows beside prefill chunks, and batches too large for a graph. Decode graphs: padded
rows, pending tokens, and each row's sampling settings as bit patterns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf_paged
from hf_paged.worker.prefill_graphs import PrefillGraphs, seq_capacity, token_buckets
from tests.conftest import TINY_CONFIGS, left_padded


class EagerReplay:
    """A captured graph's stand-in: a replay recomputes the step into the captured outputs."""

    def __init__(self, graphs, key: tuple):
        self.graphs, self.key, self.replays = graphs, key, 0
        graphs.clear(key[0])
        self.outputs = self.step()

    def step(self) -> tuple:
        return self.graphs.step(*self.key)

    def replay(self) -> None:
        for captured, new in zip(self.outputs, self.step()):
            captured.copy_(new)
        self.replays += 1

    def reset(self) -> None:
        """What ``ModelRunner.drop_graphs`` calls on closing: nothing is held."""


def stand_ins(graphs, keys: list[tuple]) -> dict:
    with torch.inference_mode():
        return {key: EagerReplay(graphs, key) for key in keys}


def with_eager_prefill_graphs(engine, max_tokens: int, max_seqs: int, adapters: bool = False
                              ) -> list[EagerReplay]:
    """Prefill graphs of up to ``max_tokens`` tokens as eager stand-ins (``adapters``: also
    those adding LoRA deltas; the engine holds an adapter already)."""
    runner = engine.executor.runner
    graphs = runner.new_prefill_graphs(max_tokens, max_seqs)
    replays = stand_ins(graphs, [(b, a) for a in ((False, True) if adapters else (False,))
                                 for b in graphs.buckets])
    graphs.graphs = {key: (r, *r.outputs) for key, r in replays.items()}
    graphs.with_adapters = adapters
    runner.prefill_graphs = graphs
    return list(replays.values())


def with_eager_decode_graphs(engine, max_bs: int, adapters: bool = False
                             ) -> list[EagerReplay]:
    """Decode graphs of up to ``max_bs`` rows as eager stand-ins (``adapters``: also those
    adding LoRA deltas; the engine holds an adapter already)."""
    runner = engine.executor.runner
    graphs = runner.new_decode_graphs(max_bs)
    replays = stand_ins(graphs, graphs.keys() + (graphs.keys(True) if adapters else []))
    graphs.graphs = {key: (r, *r.outputs) for key, r in replays.items()}
    graphs.with_adapters = adapters
    runner.decode_graphs = graphs
    run = runner.run

    def run_and_copy(plan, inputs):
        """The drawn tokens are a view of the graph's outputs: a GPU copies them to the host
        before the next replay (same stream); on CPU the next replay would come first."""
        step = run(plan, inputs)
        if step.tokens is not None:
            step.tokens = step.tokens.clone()
        return step

    runner.run = run_and_copy
    return list(replays.values())


def test_buckets_double_up_to_the_token_budget():
    assert token_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(100) == [32, 64, 100]
    assert token_buckets(16) == [16]


def test_bucket_capacity_grows_and_a_crowded_step_takes_a_larger_bucket():
    assert [seq_capacity(b, 256) for b in token_buckets(8192)] == [
        8, 8, 8, 8, 16, 32, 64, 128, 256]
    assert seq_capacity(8192, 64) == 64 and seq_capacity(32, 4) == 4
    graphs = PrefillGraphs(None, None, 1024, 32, 4, torch.device("cpu"), 64)

    def step(tokens, seqs, rows, shared=0):
        return SimpleNamespace(ids=[0] * tokens, seq_lens=[1] * seqs, logits_rows=[0] * rows,
                               shared=shared)

    assert graphs.bucket(step(100, 3, 3)) == 128
    assert graphs.bucket(step(100, 12, 12)) == 512  # 128 and 256 hold 8 sequences
    assert graphs.bucket(step(20, 32, 32)) == 1024
    assert graphs.bucket(step(20, 33, 33)) == 0  # more than any bucket holds: eager
    assert graphs.bucket(step(20, 2, 65)) == 0  # logits rows: at most 64 (capacity 32)
    assert graphs.bucket(step(1025, 2, 2)) == 0
    assert graphs.bucket(step(20, 2, 2, shared=16)) == 0  # cascade: eager


@pytest.mark.parametrize(("name", "lengths", "options", "max_tokens", "max_seqs"), [
    # Mixed lengths around the blocks' edges, the whole batch in one graph, then decode
    # batches in graphs too (the general attention kernel serves one-token rows).
    ("gqa_tied", [1, 7, 8, 9, 17, 40], {}, 128, 8),
    # Twelve rows: steps of up to 256 tokens hold eight sequences, so the decode steps take
    # the 512-token bucket (capacity 16).
    ("gqa_tied", [3, 5, 8, 9, 11, 16, 17, 20, 24, 31, 33, 40], {}, 512, 16),
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
    replays = with_eager_prefill_graphs(engine, max_tokens, max_seqs)
    for _ in range(2):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10), ref)
    assert sum(r.replays for r in replays) > 0


@pytest.mark.parametrize("sampling", [
    {},
    # Sampled rows draw inside the graph: top-k 1 leaves the argmax whatever the draw, so the
    # temperature, top-k and top-p fields must reach the sampling kernel intact.
    dict(do_sample=True, temperature=0.7, top_k=1, top_p=0.9),
])
def test_decode_graph_inputs_give_transformers_tokens(checkpoints, hf_models, sampling):
    name = "gqa_tied"
    ids, mask = left_padded([3, 9, 17, 25, 5, 40], TINY_CONFIGS[name]["vocab_size"], seed=6)
    ref = hf_models[name].generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    # Up to 4 rows: the six-row batch decodes eagerly until rows finish at staggered lengths.
    engine = hf_paged.from_pretrained(checkpoints[name], block_size=8)
    replays = with_eager_decode_graphs(engine, max_bs=4)
    max_new = [12, 4, 8, 2, 12, 6]
    outputs = engine.generate_tokens(
        [row[m.bool()].tolist() for row, m in zip(ids, mask)],
        [hf_paged.SamplingParams(max_new_tokens=n, **{k: v for k, v in sampling.items()
                                                       if k != "do_sample"})
         for n in max_new])
    for out, n, row in zip(outputs, max_new, ref):
        assert out == row[ids.shape[1] : ids.shape[1] + n].tolist()
    assert sum(r.replays for r in replays) > 0
