"""Sampling: greedy rows exact, sampled rows drawn from the reference's kept-set distribution."""

from __future__ import annotations

import math

import pytest
import torch

from hf_paged.kernels import reference, sampling
from hf_paged.kernels.sampling import sample
from tests.kernels.conftest import DEVICE

# Draws per distribution check: the interpreter runs one row at a time, slowly.
DRAWS = 20000 if DEVICE.type == "cuda" else 100


def expected_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0):
    """The distribution ``reference.sample`` draws from, for one row (ties have probability 0
    with continuous random logits), by transformers' warpers in their order."""
    x, rank = row.double() / temperature, torch.arange(row.numel(), device=row.device)
    sorted_x, order = x.sort(descending=True)
    if top_k > 0:
        sorted_x[rank >= top_k] = -math.inf
    probs = sorted_x.softmax(-1)
    sorted_x[(probs.cumsum(-1) - probs >= top_p) & (rank > 0)] = -math.inf
    probs = sorted_x.softmax(-1)
    sorted_x[probs < min_p * probs[0]] = -math.inf
    return torch.zeros_like(x).scatter(0, order, sorted_x.softmax(-1))


def draw(fn, row, temperature, top_k, top_p, n, seed, min_p=0.0):
    """``n`` tokens from ``fn`` on ``n`` copies of ``row`` (a stride-0 view: no copies)."""
    gen = torch.Generator(device=row.device).manual_seed(seed)
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype, device=row.device)  # noqa: E731
    return fn(row.expand(n, -1), full(temperature, torch.float32), full(top_k, torch.long),
              full(top_p, torch.float32), full(min_p, torch.float32), generator=gen)


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Never a token outside the kept set; frequencies within 4.5 standard errors (+0.005)
    of ``probs``, and a chi-square statistic far from its tail."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "token outside the top-k/top-p set"
    p = probs[kept]
    freq = counts[kept] / n
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / n).sqrt() + 0.005).all(), (freq, p)
    dof = max(int(kept.sum()) - 1, 1)
    chi2 = ((counts[kept] - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 6, chi2


# (temperature, top_k, top_p, min_p): min-p alone (the searching path), after top-p, and
# after the one-pass top-k path.
CONFIGS = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.5, 0, 0.6, 0.0), (0.9, 8, 0.75, 0.0),
           (1.0, 0, 1.0, 0.1), (1.2, 0, 0.9, 0.05), (0.6, 20, 0.95, 0.2)]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CONFIGS)
def test_sampled_distribution(temperature, top_k, top_p, min_p):
    row = torch.randn(24, generator=torch.Generator().manual_seed(top_k)).to(DEVICE) * 1.5
    probs = expected_probs(row, temperature, top_k, top_p, min_p)
    if min_p:  # the settings leave a few tokens, not one
        assert 1 < probs.count_nonzero() < 24
    # The oracle above is the reference's distribution...
    assert_follows(draw(reference.sample, row, temperature, top_k, top_p, 20000, 0, min_p),
                   probs)
    # ...and the kernel draws from it.
    assert_follows(draw(sample, row, temperature, top_k, top_p, DRAWS, 1, min_p), probs)


def test_min_p_matches_transformers_warper():
    """The set min-p keeps is transformers' MinPLogitsWarper's, after its top-k and top-p."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    row = torch.randn(1, 500, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_k, top_p, min_p in [(0.6, 20, 0.95, 0.05), (1.0, 0, 1.0, 0.2)]:
        scores = TemperatureLogitsWarper(temperature)(None, row.clone())
        for warper in (TopKLogitsWarper(top_k) if top_k else None, TopPLogitsWarper(top_p),
                       MinPLogitsWarper(min_p)):
            scores = scores if warper is None else warper(None, scores)
        kept = scores[0] > -math.inf
        ours = expected_probs(row[0], temperature, top_k, top_p, min_p) > 0
        assert torch.equal(kept, ours) and 1 < int(kept.sum()) < 500


@pytest.mark.parametrize("torch_argmax_rows", [0, 16])
def test_greedy_rows_exact_and_sampled_rows_kept(monkeypatch, torch_argmax_rows):
    monkeypatch.setattr(sampling, "_TORCH_ARGMAX_ROWS", torch_argmax_rows)
    vocab = 300
    logits = torch.randn(6, vocab, device=DEVICE)
    logits[0, [17, 200]] = logits[1, [5, 9]] = 10.0  # ties: the lowest index wins
    temperature = torch.tensor([0.0, 0.0, 0.8, 0.0, 1.2, 0.5], device=DEVICE)
    top_k = torch.tensor([0, 3, 4, 0, 0, 1], device=DEVICE)
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.3, 1.0], device=DEVICE)
    buffer = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    out = sample(logits, temperature, top_k, top_p, out=buffer[:6])  # as decode graphs draw
    assert out.dtype == torch.int64 and out.data_ptr() == buffer.data_ptr()
    assert buffer[6:].tolist() == [-1, -1]
    greedy = temperature == 0
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert out[0] == 17 and out[1] == 5
    for row in (2, 4, 5):
        probs = expected_probs(logits[row], *(t[row].item() for t in (temperature, top_k, top_p)))
        assert probs[out[row]] > 0
    assert out[5] == logits[5].argmax()  # top_k = 1


def test_ties_at_the_kth_logit_are_all_kept():
    """More tokens tie at the k-th logit than the one-pass top-k path holds: every one stays
    drawable, as transformers' top-k keeps ties."""
    row = torch.zeros(100, device=DEVICE)
    row[:2] = 1.0
    tokens = draw(sample, row, 1.0, 3, 1.0, DRAWS, 5)
    tied = tokens[tokens >= 2]
    assert tied.numel() > DRAWS // 3 and tied.unique().numel() > 10


def test_top_k_over_several_tiles_of_lanes(monkeypatch):
    """A row of several tiles (32 tokens here, to stay fast) whose largest logits share lanes:
    the one-pass top-k still finds the row's k largest."""
    monkeypatch.setattr(sampling, "_TILE", (32, 8, 4))
    vocab = 200
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for tile in range(7):  # the same lanes in every tile hold the largest logits
        for lane in (3, 7):
            if tile * 32 + lane < vocab:
                row[tile * 32 + lane] = 6.0 + tile + lane / 32
    for top_k, top_p in ((6, 1.0), (20, 0.8)):
        probs = expected_probs(row, 0.8, top_k, top_p)
        assert_follows(draw(sample, row, 0.8, top_k, top_p, DRAWS, top_k), probs)


def test_generator_makes_draws_reproducible():
    row = torch.randn(40, device=DEVICE)
    first, second = (draw(sample, row, 1.0, 0, 0.9, 8, seed=3) for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 50, 1.0), (0.8, 0, 0.9),
                                                      (1.0, 20, 0.8), (1.0, 0, 1.0)])
def test_full_vocabulary(temperature, top_k, top_p):
    # Peaked logits over Qwen3's vocabulary: the kept set stays small enough to count.
    row = torch.randn(151936, device=DEVICE) * 2
    row[torch.randperm(151936, device=DEVICE)[:30]] += 12
    probs = expected_probs(row, temperature, top_k, top_p)
    if probs.count_nonzero() > 200:  # plain temperature: too many tokens to count; check the top
        tokens = draw(sample, row, temperature, top_k, top_p, DRAWS, 0)
        top = probs.topk(10).indices
        freq = (tokens[:, None] == top[None, :]).double().mean(0)
        assert (freq - probs[top]).abs().max() < 0.02
    else:
        assert_follows(draw(sample, row, temperature, top_k, top_p, DRAWS, 0), probs)


@pytest.mark.parametrize("torch_argmax_rows", [0, 16])  # the kernel's argmax, torch's
def test_greedy_rows_take_the_lowest_index_across_lanes(monkeypatch, torch_argmax_rows):
    """Tied maxima in different lanes and tiles: the lowest index wins, as ``torch.argmax``."""
    monkeypatch.setattr(sampling, "_TILE", (32, 8, 4))
    monkeypatch.setattr(sampling, "_TORCH_ARGMAX_ROWS", torch_argmax_rows)
    logits = torch.randn(3, 100, device=DEVICE)
    logits[0, [40, 10]] = 9.0  # lane 8 of tile 1, lane 10 of tile 0
    logits[1, [33, 5, 70]] = 9.0  # lane 1 of tile 1, lane 5 of tile 0, lane 6 of tile 2
    logits[2, 99] = 9.0
    zeros = torch.zeros(3, device=DEVICE)
    out = sample(logits, zeros, zeros.long(), zeros + 1.0)
    assert out.tolist() == [10, 5, 99]
