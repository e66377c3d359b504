"""The draft-model proposer on CPU (float32): drafts are the draft model's own greedy
continuation, batched over sequences of different lengths, after rounds of partly rejected
drafts (the kept cache truncated, a published block among it) too; the confidence threshold
and EOS stop drafting; a draft cache without room gives no drafts and no error; every block
comes back."""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged.engine.engine import EngineCore
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.speculation.draft_proposer import DraftProposer, common_prefix_len
from hf_paged.sampling_params import SamplingParams, Speculation
from tests.conftest import SMALL, TINY_CONFIGS

NAME = "gqa_tied"
VOCAB = TINY_CONFIGS[NAME]["vocab_size"]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """A plain engine of the draft model: its greedy continuations are the oracle."""
    with EngineCore.from_pretrained(checkpoints[NAME], **SMALL) as engine:
        yield engine


def draft_engine(checkpoints, **options) -> EngineCore:
    return EngineCore.from_pretrained(checkpoints[NAME], **{**SMALL, **options})


def greedy(reference: EngineCore, seqs: list[Sequence], counts: list[int]) -> list[list[int]]:
    return reference.generate_tokens([list(s.token_ids) for s in seqs],
                                     [SamplingParams(max_new_tokens=k) for k in counts])


def target(proposer: DraftProposer, tokens: list[int], threshold: float | None = None,
           **params) -> Sequence:
    """A target request that speculates with ``proposer``."""
    speculation = Speculation(proposer=proposer, num_tokens=4, confidence_threshold=threshold)
    return Sequence(tokens, SamplingParams(speculation=speculation, **params))


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([], [1]) == 0


def test_drafts_are_the_draft_models_greedy_continuation(checkpoints, reference):
    # A 20-token budget: the 45-token prompt is computed in chunks beside the others.
    engine = draft_engine(checkpoints, max_num_batched_tokens=20, max_num_seqs=2)
    proposer = DraftProposer(engine)
    seqs = [target(proposer, p) for p in prompts([1, 7, 8, 9, 45])]
    limits = [4, 1, 3, 5, 2]
    assert proposer.propose(seqs, limits) == greedy(reference, seqs, limits)
    # Again, nothing new on the target's side: the same drafts from the kept cache.
    assert proposer.propose(seqs, limits) == greedy(reference, seqs, limits)


def test_drafts_follow_the_target_after_rejections(checkpoints, reference):
    engine = draft_engine(checkpoints)  # blocks of 8, prefix caching on
    proposer = DraftProposer(engine)
    first = prompts([13, 5, 30], seed=1)
    seqs = [target(proposer, p) for p in first]
    bm = engine.block_manager
    # Drafts each round kept by the target, then a token of its own.
    accepted = [[1, 0, 4], [2, 4, 0], [0, 3, 4], [4, 1, 2]]
    rng = random.Random(2)
    for round_, kept in enumerate(accepted):
        drafts = proposer.propose(seqs, [5] * len(seqs))
        assert drafts == greedy(reference, seqs, [5] * len(seqs))
        if round_ == 0:
            # 13 tokens and 5 drafts: the second block (positions 8 to 15) was computed whole
            # and published (once a later step's allocation knew its last token); the target
            # departs from the drafts inside it, at position 14.
            draft_seq = proposer.drafts[seqs[0].seq_id]
            assert bm.blocks[draft_seq.block_table[1]].hash is not None
            stale = first[0] + drafts[0]
        for seq, d, k in zip(seqs, drafts, kept):
            own = (d[k] + 1) % VOCAB if k < len(d) else rng.randrange(3, VOCAB)
            seq.token_ids += d[:k] + [own]
    # The sequence kept its draft sequence (its cache truncated, not rebuilt) ...
    assert proposer.drafts[seqs[0].seq_id] is draft_seq
    # ... and the block rewritten from position 14 no longer serves its old tokens.
    newcomer = target(proposer, stale)
    assert proposer.propose([newcomer], [4]) == greedy(reference, [newcomer], [4])


def test_release_and_close_give_every_block_back(checkpoints):
    engine = draft_engine(checkpoints)
    proposer = DraftProposer(engine)
    seqs = [target(proposer, p) for p in prompts([3, 17, 40], seed=3)]
    proposer.propose(seqs, [4, 4, 4])
    bm = engine.block_manager
    assert bm.num_free_blocks < bm.num_blocks
    proposer.release([seqs[0].seq_id, seqs[1].seq_id])
    assert list(proposer.drafts) == [seqs[2].seq_id]
    proposer.release([seqs[2].seq_id, 12345])  # unknown ids are ignored
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.executor.runner.preparer.block_tables.state
    # close() frees what is left; the engine, not owned, stays open.
    proposer.propose(seqs, [2, 2, 2])
    proposer.close()
    assert bm.num_free_blocks == bm.num_blocks and not engine.closed
    owner = DraftProposer(engine, owns_engine=True)
    owner.close()
    assert engine.closed


def transformers_greedy(model, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``tokens`` and each token's probability under the
    softmax of its logits (what ``ConfidenceCriteria`` reads from a greedy assistant)."""
    out = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens)),
                         max_new_tokens=k, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    new = out.sequences[0, len(tokens):].tolist()
    probs = [step[0].float().softmax(-1)[t].item() for step, t in zip(out.logits, new)]
    return new, probs


@pytest.mark.parametrize("threshold", [1.0, 0.0, "between"])
def test_confidence_threshold_stops_after_an_unsure_draft(checkpoints, hf_models, threshold):
    proposer = DraftProposer(draft_engine(checkpoints))
    tokens = prompts([4, 11, 20, 6], seed=4)
    expected = [transformers_greedy(hf_models[NAME], t, 6) for t in tokens]
    if threshold == "between":  # halfway between two of the probabilities: never at one
        ranked = sorted(p for _, row in expected for p in row)
        threshold = (ranked[len(ranked) // 2] + ranked[len(ranked) // 2 + 1]) / 2
    seqs = [target(proposer, t, threshold) for t in tokens]
    drafts = proposer.propose(seqs, [6] * len(seqs))
    for d, (want, probs) in zip(drafts, expected):
        stop = next((i for i, p in enumerate(probs) if p < threshold), len(probs) - 1)
        assert d == want[: stop + 1]
    if threshold == 1.0:
        assert all(len(d) == 1 for d in drafts)
    if threshold == 0.0:
        assert all(len(d) == 6 for d in drafts)
    assert len({len(d) for d in drafts}) > 1 or threshold in (0.0, 1.0)  # stops in between


def test_eos_stops_drafting_and_ignore_eos_does_not(checkpoints, reference):
    proposer = DraftProposer(draft_engine(checkpoints))
    tokens = prompts([9, 16], seed=5)
    plain = [target(proposer, t) for t in tokens]
    expected = greedy(reference, plain, [5, 5])
    eos = expected[0][2]  # the first sequence's third draft
    seqs = [target(proposer, tokens[0], eos_token_ids=(eos,)),
            target(proposer, tokens[1], eos_token_ids=(eos,), ignore_eos=True)]
    drafts = proposer.propose(seqs, [5, 5])
    assert drafts[0] == expected[0][: expected[0].index(eos) + 1]
    assert drafts[1] == expected[1]


def test_a_cache_without_room_gives_no_drafts_and_no_error(checkpoints, reference):
    # Four blocks of 8 tokens: a 40-token sequence never fits.
    engine = draft_engine(checkpoints, num_kv_blocks=4)
    proposer = DraftProposer(engine)
    long, short, other = (target(proposer, p) for p in prompts([40, 6, 20], seed=6))
    drafts = proposer.propose([long, short], [4, 4])
    assert drafts == [[], greedy(reference, [short], [4])[0]]
    assert long.seq_id not in proposer.drafts and proposer.num_no_room == 1
    # 20 tokens need three blocks, the short one's draft holds two of the four: freed, since
    # it takes no part in this call, and rebuilt when it drafts again.
    assert proposer.propose([other], [4]) == greedy(reference, [other], [4])
    assert short.seq_id not in proposer.drafts
    proposer.release([other.seq_id])
    assert proposer.propose([short], [4]) == greedy(reference, [short], [4])
    proposer.close()
    assert engine.block_manager.num_free_blocks == 4


def test_never_drafts_past_the_draft_models_length(checkpoints, reference):
    engine = draft_engine(checkpoints, max_model_len=32)
    proposer = DraftProposer(engine)
    near, at = (target(proposer, p) for p in prompts([30, 32], seed=7))
    assert proposer.propose([near, at], [4, 4]) == [greedy(reference, [near], [2])[0], []]
