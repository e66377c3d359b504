"""The batch-1 lines of the speculation benchmark (``benchmarks.bench_speculation``): hf_paged
plain and speculative, and transformers' own, each timed request by request, its speculation
counts read from ``engine.stats()`` and every output checked against plain greedy's and the
permutation's walk (``benchmarks.known_acceptance``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks import common
from benchmarks import known_acceptance as known

COUNTS = ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps")
Generate = Callable[[list[int], int], list[int]]


@dataclass
class Line:
    """One measurement: ``speculation`` are the generate() keywords that speculate (none:
    plain), ``facts`` go into the result as they are; a draft's ``draft_successor`` gives the
    per-token agreement along the walks made."""

    label: str
    prompts: str  # "random" or "repeating"
    speculation: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    draft_successor: list[int] | None = None


@dataclass
class Context:
    """What every line of a run shares: the prompts of each kind (the first one warms up),
    new tokens and drafts a step, plain greedy's outputs once measured, the target's
    successor."""

    prompts: dict[str, list[list[int]]]
    new_tokens: int
    drafts: int
    successor: list[int]
    device: torch.device
    plain: dict[str, list[list[int]]] = field(default_factory=dict)
    plain_ms: dict[str, float] = field(default_factory=dict)


def greedy(model, device: torch.device, **extra: Any) -> Generate:
    """``prompt, new_tokens -> new token ids`` through ``model.generate`` (stock or hf_paged)."""
    def run(prompt: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, **extra)
        return out[0, len(prompt):].tolist()
    return run


def as_assistant(model, num_tokens: int):
    """transformers' assistant knobs, which both libraries read from the draft's own
    generation config: ``num_tokens`` drafts a step, constant, and the confidence threshold
    off (0; None would mean transformers' default 0.4), so every step proposes them all."""
    config = model.generation_config
    config.num_assistant_tokens = num_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return model


def time_requests(generate: Generate, prompts: list[list[int]], new_tokens: int,
                  device: torch.device, before: Callable[[], Any] = lambda: None
                  ) -> tuple[dict, list[list[int]], Any]:
    """A warm-up request on ``prompts[0]``, ``before()``, then each other prompt timed alone:
    the median ms per new token (its prefill included), the outputs of the timed requests
    and what ``before()`` returned (counts taken after the warm-up)."""
    first = common.timed(lambda: generate(prompts[0], new_tokens), device)[1]
    taken = before()
    outputs, samples = [], []
    for prompt in prompts[1:]:
        out, seconds = common.timed(lambda p=prompt: generate(p, new_tokens), device)
        outputs.append(out)
        samples.append(seconds)
    ms = statistics.median(samples) * 1e3 / new_tokens
    return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "new_tokens": new_tokens,
            "samples_s": samples, "first_request_ms": first * 1e3}, outputs, taken


def counts(engine) -> dict[str, int]:
    stats = engine.stats()
    return {name: stats.get(name, 0) for name in COUNTS}


def acceptance(before: dict, after: dict, generated: int, drafts: int) -> dict:
    """A run's speculation counts, the acceptance they give and its tokens a step. Acceptance:
    accepted over proposed drafts, and the per-token acceptance ``a`` that explains the
    accepted drafts per verify step for the drafts a verify step had on average (fewer than
    ``drafts`` near the end of a request, or where prompt lookup finds a shorter match); the
    expected tokens a step are ``a``'s with ``drafts`` drafts. Each step keeps one token of
    the model's own, so a run takes ``generated - accepted`` steps."""
    d = {name: after[name] - before[name] for name in COUNTS}
    proposed, kept, verify = d["num_draft_tokens"], d["num_accepted_tokens"], d["num_verify_steps"]
    per_token = known.acceptance_for(kept / verify, proposed / verify) if verify else None
    return {
        **d,
        "acceptance": kept / proposed if proposed else None,
        "accepted_per_verify_step": kept / verify if verify else None,
        "per_token_acceptance": per_token,
        "tokens_per_step": generated / (generated - kept),
        "expected_tokens_per_step": None if per_token is None
        else known.tokens_per_step(per_token, drafts),
    }


def checked(figures: dict, outputs: list[list[int]], plain: list[list[int]] | None,
            prompts: list[list[int]], successor: list[int]) -> dict:
    """``figures`` with whether every output is plain greedy's (its first tokens, for a
    shorter one) and the permutation's walk."""
    if plain is not None:
        figures["matches_plain"] = all(o == p[: len(o)] for o, p in zip(outputs, plain))
    figures["follows_permutation"] = all(
        o == known.continuation(successor, p, len(o)) for o, p in zip(outputs, prompts))
    return figures


def speedup(ctx: Context, prompts: str, ms_per_token: float) -> float | None:
    """Plain decoding's ms a token over ``ms_per_token``: plain on the same kind of prompts,
    else on random ones (plain decoding's speed does not depend on the tokens)."""
    base = ctx.plain_ms.get(prompts, ctx.plain_ms.get("random"))
    return None if base is None else base / ms_per_token


def measure_paged(model, line: Line, ctx: Context) -> dict:
    """One hf_paged line on ``model`` (a drop-in model: its engine counts the drafts)."""
    prompts, n, k = ctx.prompts[line.prompts], ctx.new_tokens, ctx.drafts
    figures, outputs, before = time_requests(greedy(model, ctx.device, **line.speculation),
                                             prompts, n, ctx.device, lambda: counts(model.engine))
    figures = checked(dict(figures, prompts=line.prompts, **line.facts), outputs,
                      ctx.plain.get(line.prompts), prompts[1:], ctx.successor)
    if not line.speculation:
        ctx.plain[line.prompts], ctx.plain_ms[line.prompts] = outputs, figures["ms_per_token"]
    else:
        figures["num_draft_tokens_per_step"] = k
        figures.update(acceptance(before, counts(model.engine), n * len(outputs), k))
        figures["speedup_vs_plain"] = speedup(ctx, line.prompts, figures["ms_per_token"])
    if line.draft_successor is not None:
        agree = known.agreement(ctx.successor, line.draft_successor, prompts[1:], outputs)
        figures["agreement_along_walks"] = agree
        figures["expected_tokens_per_step_from_agreement"] = known.tokens_per_step(agree, k)
    print("  " + ", ".join(f"{key} {figures[key]:.4g}" for key in
                           ("ms_per_token", "tokens_per_s", "acceptance", "tokens_per_step")
                           if isinstance(figures.get(key), float)), flush=True)
    return figures


def measure_stock(model, line: Line, ctx: Context, repeats: int) -> dict:
    """One transformers line on the first ``repeats`` measured prompts (``ctx.new_tokens``
    each: fewer than hf_paged's, stock decoding being slow), its outputs checked against the
    first tokens of hf_paged's plain ones (``ctx.plain``), a speculative one's speed-up over
    transformers' plain (``ctx.plain_ms``, which the plain line fills)."""
    prompts = ctx.prompts[line.prompts][: repeats + 1]
    figures, outputs, _ = time_requests(greedy(model, ctx.device, **line.speculation), prompts,
                                        ctx.new_tokens, ctx.device)
    figures = checked(dict(figures, prompts=line.prompts, **line.facts), outputs,
                      ctx.plain.get(line.prompts), prompts[1:], ctx.successor)
    if line.speculation:
        figures["num_draft_tokens_per_step"] = ctx.drafts
        figures["speedup_vs_plain"] = speedup(ctx, line.prompts, figures["ms_per_token"])
    else:
        ctx.plain_ms[line.prompts] = figures["ms_per_token"]
    return figures
