"""The step contract: the plain data that crosses between the engine (host side: requests,
scheduling, blocks) and the worker (device side: model, KV cache, graphs, sampling).

These are the only types the two sides share. The engine builds a ``StepPlan`` from each
scheduled batch and hands it to the executor; rank 0's worker turns it into ``StepInputs``
(which travel to the other ranks of a tensor-parallel group) and answers with a
``StepResult``. ``WorkerSpec`` says what a rank builds. Steps carry lists, ints and floats;
besides those, only rank 0's in-process fields cross: the caller's hooks and the engine's
request handles (opaque to the worker, handed back to the hooks) and, in a result, beam
candidates as host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from hf_paged.config import EngineConfig
    from hf_paged.quantization import Fp8Scheme


class LogitsHooks(Protocol):
    """A caller's callbacks that the worker runs on rank 0 over the rows of the requests that
    share them (``SamplingParams.hooks``). ``requests`` are the ``RowSampling.request``
    handles of those rows, in row order."""

    def process(self, requests: list, logits: torch.Tensor) -> torch.Tensor:
        """Scores to sample from, given the float32 logits rows of ``requests``."""

    def record(self, requests: list, tokens: torch.Tensor) -> None:
        """The tokens just drawn for ``requests`` (on the device)."""


@dataclass(frozen=True)
class CandidateRows:
    """A beam-search member's row: instead of sampling, the worker reports its best
    candidates (log-softmax scores after ``scorer``)."""

    num_candidates: int  # (score, token) pairs reported, best first
    keep_rows: bool  # also send the whole score and logit rows to the host
    # ``scorer.process(requests, log_probs)`` turns the log-softmax rows of the members that
    # share it into the scores ranked; None ranks the log-softmax as it is.
    scorer: object | None
    # Draw the candidates instead (beam sampling): the best of the scores plus Gumbel noise,
    # reported with their noisy keys, which the host merges over the beams (Gumbel-top-k: a
    # draw without replacement from the softmax of the beams' accumulated scores).
    sample: bool = False


@dataclass(frozen=True)
class RowSampling:
    """How the worker draws one request's tokens; the engine builds it once per sequence."""

    seq_id: int  # the worker's key for per-request state (pending row, repetition mask)
    temperature: float  # 0: greedy (argmax)
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    repetition_penalty: float  # 1.0: off; transformers' rule over ``history``
    # The request's tokens so far (the engine's list, read, never written): the repetition
    # penalty's seen set is filled from it the first time the request is penalized.
    history: list[int]
    hooks: LogitsHooks | None  # rank 0 callbacks over this row's logits and tokens
    request: object  # the engine's handle of the request, handed back to hooks and scorers
    candidates: CandidateRows | None = None  # set on beam-search members: report, not sample
    min_p: float = 0.0  # 0.0: off; after top-p, as transformers' warpers run

    @property
    def processed(self) -> bool:
        """Whether the row's logits go through penalties or hooks before sampling."""
        return self.repetition_penalty != 1.0 or self.hooks is not None


@dataclass
class StepPlan:
    """One scheduled step, from the engine: sequence ``i`` computes ``num_tokens[i]`` tokens
    from position ``starts[i]``. Lists are by sequence, in batch order."""

    seq_ids: list[int]
    starts: list[int]
    num_tokens: list[int]
    # Each sequence's tokens known to the host (the engine's lists, read, never written). A
    # position at or past the end is a token still pending on the device: the one the last
    # step sampled for this sequence.
    token_ids: list[list[int]]
    block_tables: list[list[int]]  # each sequence's cache blocks (the engine's lists, read)
    sample: list[bool]  # whether the chunk reaches the sequence's end: a token is drawn
    sampling: list[RowSampling]  # each sequence's settings (read for the sampled ones)
    # Followers forked by this step: each draws its own token from the logits row of batch
    # entry ``index``, with its own settings.
    sample_copies: list[tuple[int, RowSampling]]
    block_copies: list[tuple[int, int]]  # copy-on-write (source, destination), in order
    is_decode: bool  # every sequence computes exactly its newest token, and samples it
    # Speculative decoding: the chunk of sequence ``i`` ends with this many draft tokens, and
    # a token is drawn at each of its last ``1 + num_draft_tokens[i]`` positions (empty: none).
    num_draft_tokens: list[int] = field(default_factory=list)
    # Also report the probability each drawn token had (a draft model's confidence).
    report_probs: bool = False
    # Each sequence's LoRA adapter slot (-1: the base model); empty: none in the step.
    lora_slots: list[int] = field(default_factory=list)
    # A hybrid model's (empty otherwise): each sequence's state slot, whether the slot holds
    # the state after its tokens before this chunk (False: its first chunk, or a recompute),
    # and the slot copies (source, destination) of forks to make before the forward, in order.
    state_slots: list[int] = field(default_factory=list)
    has_initial_state: list[bool] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepInputs:
    """A step's inputs as host data, from rank 0's plan: what every rank needs to run the
    same forward (the tensor-parallel wire carries exactly this).

    Per token: ``ids`` (0 where pending), ``src`` (its row in the last step's samples, or -1),
    ``positions``, ``slots``. Per sequence: ``cu_seqlens`` (B+1), ``seq_lens``, ``tables``
    (block-table rows). ``logits_rows``: the token rows whose logits are sampled. ``graph_bs``:
    the decode graph to replay (0: eager); ``shared``: cascade prefix tokens (0: none).
    """

    ids: list[int]
    src: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    tables: np.ndarray
    logits_rows: list[int]
    max_query_len: int
    graph_bs: int
    shared: int
    block_copies: list[tuple[int, int]]  # made before the forward, in order
    # Tokens the step draws that the next step may read on the device as pending inputs:
    # sampled rows of no group, then one per follower forked by it (0 for a step verifying
    # drafts, whose tokens the host reads before it schedules the next).
    num_drawn: int
    # Per sequence: its LoRA adapter slot (-1: none); empty when no sequence has one.
    lora_slots: list[int] = field(default_factory=list)
    # A hybrid model's, as in ``StepPlan`` (empty otherwise).
    state_slots: list[int] = field(default_factory=list)
    has_initial_state: list[bool] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ModelCall:
    """The model call (transformers' forward over padded rows), as every rank of a
    tensor-parallel group runs it (sent to the others as host tensors): ``[batch, seq_len]``
    ids, mask and positions, each row's adapter slot (-1: none; None: no row has one),
    ``logits_to_keep`` as transformers takes it (None: the final hidden states, not the
    logits), and whether transformers' ``hidden_states`` (every layer's) come too."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    lora_slots: list[int] | None = None
    logits_to_keep: int | torch.Tensor | None = None
    output_hidden_states: bool = False


@dataclass
class StepResult:
    """A step's answer, once collected."""

    # One token per sampled row that belongs to no beam group, in batch order, then one per
    # follower in ``StepPlan.sample_copies`` order.
    tokens: list[int]
    # One per beam-group member's sampled row, in batch order: (top scores, their token ids,
    # the whole score row or None, the whole logit row or None, the drawn candidates' keys or
    # None), host tensors.
    candidates: list[tuple]
    # With ``StepPlan.report_probs``: the probability of each token of ``tokens``.
    probs: list[float] = field(default_factory=list)


@dataclass
class WorkerSpec:
    """What a rank needs to build its model shard and worker (pickled to spawned ranks)."""

    hf_config: PretrainedConfig
    checkpoint: str  # a local folder
    dtype: torch.dtype
    device: torch.device  # rank 0's; rank r of a spawned group takes the r-th GPU after it
    config: EngineConfig
    max_model_len: int
    # The checkpoint's quantization as ``check_spec`` resolved it (None: unquantized).
    quantization: Fp8Scheme | None = None
