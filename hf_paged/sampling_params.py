"""SamplingParams (per request) and the GenerationConfig -> SamplingParams mapping."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import GenerationConfig


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 is greedy decoding; above 0 samples from ``softmax(logits / T)``.
        top_k: keep only the k most likely tokens when sampling (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        eos_token_ids: any of these ends the request (the token itself is kept).
        ignore_eos: keep generating past EOS tokens (benchmarks).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

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
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


def from_generation_config(config: GenerationConfig, max_new_tokens: int) -> SamplingParams:
    """Map a validated GenerationConfig onto SamplingParams the way transformers' warpers act.

    ``do_sample=False`` is greedy whatever the temperature says; when sampling, transformers
    requires a strictly positive temperature and treats ``top_k=None`` as off.
    """
    eos = config.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if not config.do_sample:
        return SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids)
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    if not temperature > 0:
        raise ValueError(
            f"temperature must be strictly positive when do_sample=True, got {temperature!r}"
        )
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = config.top_k or 0
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_ids=eos_ids,
    )
