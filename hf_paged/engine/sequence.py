"""One request: its tokens, status, KV block table and SamplingParams. Plain data."""

from __future__ import annotations

import enum
import itertools

from hf_paged.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's state as the scheduler and block manager see it.

    ``token_ids`` holds the prompt followed by every generated token the host has seen;
    ``num_pending`` more were sampled by steps still running on the device (their values reach
    the host one step later: asynchronous scheduling). ``num_computed_tokens`` counts the tokens
    whose K/V are in the cache or being written by a scheduled step (prefix-cache hits
    included); the tokens after it are what the next step must compute. ``block_table[i]`` is
    the cache block holding tokens ``i*block_size`` to ``(i+1)*block_size - 1``.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: object = None):
        self.seq_id = next(_ids)
        self.request_id = self.seq_id if request_id is None else request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, in order
        self.num_published_blocks = 0  # leading blocks of block_table already offered for reuse
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known to the host plus those still being sampled."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
