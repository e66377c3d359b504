"""``StepPlan.report_probs``: each drawn token's probability under the float32 softmax of its
row's raw logits (what transformers' ``ConfidenceCriteria`` reads from a greedy assistant),
equal to transformers' own, on the eager path and on both graphs' paths (CPU stand-ins of the
captured graphs); a repetition-penalized row reports its raw logits' probability too. A plan
that does not ask reports nothing."""

from __future__ import annotations

import pytest
import torch

from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.engine import EngineCore
from hf_paged.engine.sequence import Sequence
from hf_paged.sampling_params import SamplingParams
from tests.conftest import SMALL, left_padded
from tests.parity.test_graph_inputs import with_eager_decode_graphs, with_eager_prefill_graphs

NAME = "gqa4_untied"


def run_steps(engine: EngineCore, seqs: list[Sequence], num_steps: int, report: bool = True
              ) -> list[tuple[list[int], int, float]]:
    """A first step computing each sequence's tokens, then one-token steps, all drawing;
    returns (tokens before, token drawn, probability reported) for every row."""
    bm, records = engine.block_manager, []
    for _ in range(num_steps):
        batch = ScheduledBatch()
        for seq in seqs:
            n = len(seq) - seq.num_computed_tokens
            assert bm.allocate(seq, n)
            batch.seqs.append(seq)
            batch.starts.append(seq.num_computed_tokens)
            batch.num_tokens.append(n)
            batch.sample.append(True)
            seq.num_computed_tokens += n
        plan = batch.plan()
        plan.report_probs = report
        result = engine.executor.collect(engine.executor.launch(plan))
        assert len(result.probs) == (len(seqs) if report else 0)
        for seq, token, prob in zip(seqs, result.tokens, result.probs or [None] * len(seqs)):
            records.append((list(seq.token_ids), token, prob))
            seq.token_ids.append(token)
    for seq in seqs:
        bm.free(seq)
    engine.executor.release([s.seq_id for s in seqs])
    return records


@pytest.mark.parametrize("path", ["eager", "prefill_graph", "decode_graph"])
def test_reported_probabilities_are_transformers_softmax(checkpoints, hf_models, path):
    engine = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    replays = {"eager": lambda: [],
               "prefill_graph": lambda: with_eager_prefill_graphs(engine, 64, 4),
               "decode_graph": lambda: with_eager_decode_graphs(engine, 4)}[path]()
    ids, mask = left_padded([5, 12, 30], hf_models[NAME].config.vocab_size, seed=3)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams()]
    records = run_steps(engine, [Sequence(p, q) for p, q in zip(prompts, params)], 4)
    assert not replays or sum(r.replays for r in replays) > 0
    with torch.no_grad():
        for i, (tokens, token, prob) in enumerate(records):
            logits = hf_models[NAME](torch.tensor([tokens])).logits[0, -1].float()
            assert prob == pytest.approx(logits.softmax(-1)[token].item(), abs=1e-5)
            if params[i % len(params)].repetition_penalty == 1.0:  # greedy: the top one
                assert token == logits.argmax().item()


def test_no_report_unless_asked(checkpoints):
    engine = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    records = run_steps(engine, [Sequence([5, 6, 7], SamplingParams())], 2, report=False)
    assert [prob for *_, prob in records] == [None, None]
