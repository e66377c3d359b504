"""Torchrun mode: every rank of a tensor-parallel group runs the user's script, so every rank
queues the same requests; rank 0 schedules and samples, and at the end of each ``run`` sends
the other ranks its outcome, which they adopt as their own.

The outcome is each request's new tokens and finish reason, plus the state of the hooks
objects that carry some to other ranks (``shared_state``/``load_shared_state``: per-step
scores, say), or the error's text when rank 0 failed.
"""

from __future__ import annotations

from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence


def _shared_hooks(seqs: list[Sequence]) -> list:
    """The distinct hooks objects of ``seqs`` that carry state to other ranks, in order."""
    found = {}
    for seq in seqs:
        hooks = seq.params.hooks
        if hooks is not None and hasattr(hooks, "shared_state"):
            found.setdefault(id(hooks), hooks)
    return list(found.values())


def outcome(seqs: list[Sequence]) -> tuple:
    """What rank 0 sends when its ``run`` over ``seqs`` has finished."""
    return ([(s.output_token_ids, s.finish_reason) for s in seqs],
            [hooks.shared_state() for hooks in _shared_hooks(seqs)])


def adopt(seqs: list[Sequence], received: tuple, scheduler: Scheduler) -> None:
    """Rank 0's outcome into this rank's ``seqs`` (queued here only to be validated)."""
    results, hook_states = received
    if len(results) != len(seqs):
        raise RuntimeError(
            f"rank 0 ran {len(results)} requests where this rank queued {len(seqs)}: every "
            "rank must make the same generate() calls"
        )
    for seq, (tokens, reason) in zip(seqs, results):
        scheduler.abort(seq)  # rank 0 schedules
        # rank 0's new tokens include any this rank's request began with (a masked row's first)
        del seq.token_ids[seq.num_prompt_tokens:]
        seq.token_ids.extend(tokens)
        seq.finish_reason = reason
    for hooks, state in zip(_shared_hooks(seqs), hook_states):
        hooks.load_shared_state(state)
