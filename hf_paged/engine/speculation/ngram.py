"""Prompt lookup: draft tokens copied from where a sequence's last n-gram occurred before.

transformers' ``PromptLookupCandidateGenerator`` rule, per sequence: for n from
``max_ngram`` down to 1, find the first (leftmost) earlier occurrence of the sequence's last
n tokens that some token follows, and propose what followed it, up to the limit, cut before
the first EOS (the model then draws the EOS itself, so a request never runs past an EOS it did
not choose). The search is one vectorised pass over the token list on the host, made once a
step for up to ``limit`` tokens.
"""

from __future__ import annotations

import numpy as np

from hf_paged.engine.sequence import Sequence
from hf_paged.sampling_params import Proposer


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (prompt and output)."""

    def __init__(self, max_ngram: int = 2):
        if not isinstance(max_ngram, int) or isinstance(max_ngram, bool) or max_ngram <= 0:
            raise ValueError(
                f"max_matching_ngram_size must be a positive integer, got {max_ngram!r}")
        self.max_ngram = max_ngram

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [lookup(seq.token_ids, limit, self.max_ngram, seq.params.eos_token_ids)
                for seq, limit in zip(seqs, limits)]


def lookup(tokens: list[int], limit: int, max_ngram: int, eos: tuple[int, ...] = ()
           ) -> list[int]:
    """The tokens that followed the leftmost earlier occurrence of ``tokens``' last n-gram
    (the longest n up to ``max_ngram`` that has one), at most ``limit``, cut before an EOS."""
    length = len(tokens)
    if length < 2 or limit <= 0:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), 0, -1):
        # Windows starting before length - n: the last n-gram itself has no follower.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            drafts = tokens[start: start + limit]
            for i, token in enumerate(drafts):
                if token in eos:
                    drafts = drafts[:i]
                    break
            if drafts:
                return drafts
            # transformers looks no further once a match exists, whatever the EOS left of it.
            return []
    return []
