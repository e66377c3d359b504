"""SamplingParams: how one request generates, as plain data the engine reads every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hf_paged.engine.sequence import Sequence


class RequestHooks:
    """Callbacks shared by the requests of one caller (one ``generate()`` call, say).

    The engine batches the requests that share a hooks object: ``process`` receives all of
    them that sample in a step at once. Subclasses override what they need.
    """

    #: ``process`` reads host-side state that ``on_tokens`` updates: the engine then collects
    #: a step's tokens before it launches the next one (no asynchronous overlap).
    needs_history: bool = False

    def process(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Scores to sample from, given the float32 logits rows of ``seqs``."""
        return logits

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Called with the tokens just sampled (on the device) for the requests ``process``
        saw, before they reach the host."""

    def on_tokens(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Called once a step with the requests that received a token (already appended;
        those it finished by EOS or length included). Returns the requests to stop, each with
        the number of new tokens it keeps (a decision about an earlier token drops the later
        ones, as for a token sampled after EOS)."""
        return []

    def may_compute(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be scheduled to sample its next token now (False holds it back
        for a step; the engine overrides a hold when nothing else can run)."""
        return True


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 is greedy decoding; above 0 samples from ``softmax(logits / T)``.
        top_k: keep only the k most likely tokens when sampling (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        min_p: then keep the tokens at least ``min_p`` times as likely as the most likely one
            (0.0 = off), as transformers' ``MinPLogitsWarper``.
        repetition_penalty: transformers' rule: the logit of every token already in the
            prompt or the output is divided by it (multiplied when negative); 1.0 = off.
            Applied on the device, before temperature.
        eos_token_ids: any of these ends the request (the token itself is kept).
        ignore_eos: keep generating past EOS tokens (benchmarks).
        hooks: logits processing and stopping done by the caller (see ``RequestHooks``).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    hooks: RequestHooks | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be strictly positive, got {self.repetition_penalty!r}"
            )
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
