"""SamplingParams: how one request generates, as plain data the engine reads every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Request(Protocol):
    """A request handed to hooks and proposers. The engine hands its ``Sequence`` objects
    (``hf_paged.engine.sequence``: these fields and the rest of a request's state); this
    module sits below the engine, so it names them by this protocol."""

    seq_id: int  # unique for the engine's lifetime
    request_id: object  # the caller's id (the ``seq_id`` unless one was given)
    token_ids: list[int]  # the prompt, then every generated token the host has
    num_prompt_tokens: int
    params: SamplingParams


class RequestHooks:
    """Callbacks shared by the requests of one caller (one ``generate()`` call, say).

    The engine batches the requests that share a hooks object: ``process`` receives all of
    them that sample in a step at once. Subclasses override what they need.
    """

    #: ``process`` reads host-side state that ``on_tokens`` updates: the engine then collects
    #: a step's tokens before it launches the next one (no asynchronous overlap).
    needs_history: bool = False
    #: ``process`` changes the logits (or records them): such requests decode one token a
    #: step, since speculative decoding verifies drafts on the model's own logits.
    processes_logits: bool = True

    def process(self, seqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Scores to sample from, given the float32 logits rows of ``seqs``."""
        return logits

    def record(self, seqs: list[Request], tokens: torch.Tensor) -> None:
        """Called with the tokens just sampled (on the device) for the requests ``process``
        saw, before they reach the host."""

    def on_tokens(self, seqs: list[Request]) -> list[tuple[Request, int]]:
        """Called once a step with the requests that received a token (already appended;
        those it finished by EOS or length included). Returns the requests to stop, each with
        the number of new tokens it keeps (a decision about an earlier token drops the later
        ones, as for a token sampled after EOS)."""
        return []

    def may_compute(self, seq: Request) -> bool:
        """Whether ``seq`` may be scheduled to sample its next token now (False holds it back
        for a step; the engine overrides a hold when nothing else can run)."""
        return True


class Proposer:
    """Drafts tokens for speculative decoding (``Speculation.proposer``): prompt lookup
    (``hf_paged.engine.speculation.ngram.NgramProposer``) or a draft model
    (``hf_paged.engine.speculation.draft_proposer.DraftProposer``)."""

    def propose(self, seqs: list[Request], limits: list[int]) -> list[list[int]]:
        """Draft tokens to follow each of ``seqs`` (every token of theirs known to the host),
        at most ``limits[i]`` for ``seqs[i]`` (each limit at least 1)."""
        raise NotImplementedError

    def release(self, seq_ids: list[int]) -> None:
        """Forget the state kept for these sequences (finished, aborted or preempted)."""

    def close(self) -> None:
        """Free what the proposer holds (a draft model's engine it built)."""


# transformers' ``num_assistant_tokens_schedule`` values: "heuristic" grows the draft length by
# 2 after a step accepts every draft and shrinks it by 1 otherwise ("heuristic_transient" the
# same, starting again from ``num_tokens`` each call); "constant" keeps it.
SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for a request: ``proposer`` drafts up to ``num_tokens`` tokens a
    step, the model verifies them in one forward, and the request keeps the drafts its own
    choices agree with plus the token after them, so greedy output is plain greedy's and
    sampled output is plain sampling's distribution.

    Attributes:
        proposer: who drafts (shared by the requests of one caller).
        num_tokens: most draft tokens a step (transformers' ``num_assistant_tokens`` or
            ``prompt_lookup_num_tokens``).
        schedule: one of ``SCHEDULES``.
        confidence_threshold: a draft model stops drafting after a token it gave a probability
            below this (transformers' ``assistant_confidence_threshold``); None: never.
    """

    proposer: Proposer
    num_tokens: int = 4
    schedule: str = "constant"
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool) \
                or self.num_tokens <= 0:
            raise ValueError(
                f"num_speculative_tokens must be a positive integer, got {self.num_tokens!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, "
                             f"got {self.schedule!r}")
        threshold = self.confidence_threshold
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"assistant_confidence_threshold must be in [0, 1] or None, got {threshold!r}")


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
        speculation: speculative decoding for this request (see ``Speculation``); None: the
            engine's own (``EngineConfig.speculative_method``), if any.
        adapter: the name of a LoRA adapter the engine holds (``EngineCore.add_lora``) to
            generate with; None: the base model.
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
    speculation: Speculation | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError(f"adapter must be an adapter's name or None, got {self.adapter!r}")
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
