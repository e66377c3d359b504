"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE on the paged modules against stock transformers with its
cache, in float32 and float64: a batch of prompts of different lengths prefilled together (one
longer than the delta rule's 64-token chunk), then greedy decode steps; a prompt prefilled in
two chunks with other sequences' decode rows in the same batch. The model is driven directly
(``tests/hybrid_steps.py``), its KV cache and state pools sized by the test.

Tolerances are fractions of the logits' size. In float64 both compute the delta rule in
float32 (transformers' casts): 9e-7 measured at logits of 15, so 2e-7 of the size pins the
numerics. In float32 these random models amplify rounding over a long prompt: transformers'
own float32 logits differ from its float64 ones by up to 2.6e-4, the paged ones by 5.9e-4
(8e-4 from transformers' float32), so 5e-5 of the size."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_paged.families.build import build_model
from tests.conftest import HYBRID_CONFIGS
from tests.hybrid_steps import HybridSteps

PROMPT_LENS = (5, 70, 1, 12)
DECODE_STEPS = 4


TOLERANCE = {torch.float32: 5e-5, torch.float64: 2e-7}  # of the logits' size (see above)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=TOLERANCE[want.dtype] * scale, rtol=0)


def prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lens]


def transformers_greedy(hf, prompt: list[int], steps: int
                        ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens after ``prompt`` with its cache, and the logits of each
    forward: the prompt's rows, then one row per decode step."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, logits, tokens = out.past_key_values, [out.logits[0]], []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0])
    return tokens, logits


@pytest.fixture(scope="module")
def models(hybrid_checkpoints):
    """(name, dtype) -> (the paged model's builder, transformers' model)."""
    def pair(name: str, dtype: torch.dtype):
        path = hybrid_checkpoints[name]
        config = transformers.AutoConfig.from_pretrained(path)
        # transformers' grouped_mm experts take no float64
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, experts_implementation="eager").eval()
        return lambda: build_model(config, path, dtype, torch.device("cpu"), "sdpa", 256), hf

    cache = {}
    return lambda name, dtype=torch.float32: cache.setdefault((name, dtype), pair(name, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_prefill_then_greedy_decode_matches_transformers(models, name, dtype):
    build, hf = models(name, dtype)
    batch = prompts(0)
    expected = [transformers_greedy(hf, p, DECODE_STEPS) for p in batch]
    steps = HybridSteps(build(), len(batch))
    logits, start = steps.step(list(enumerate(batch))), 0
    for prompt, (_, want) in zip(batch, expected):
        assert_logits_close(logits[start:start + len(prompt)], want[0])
        start += len(prompt)
    tokens = [[] for _ in batch]
    rows = logits[torch.tensor([len(p) for p in batch]).cumsum(0) - 1]  # each prompt's last
    for step in range(DECODE_STEPS):
        for seq, token in enumerate(rows.argmax(-1).tolist()):
            tokens[seq].append(token)
        rows = steps.step([(seq, seq_tokens[-1:]) for seq, seq_tokens in enumerate(tokens)])
        for seq, (_, want) in enumerate(expected):
            assert_logits_close(rows[seq], want[step + 1][0])
    assert tokens == [want_tokens for want_tokens, _ in expected]


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_tied", "qwen3.5_moe"])
def test_a_prompt_prefilled_in_two_chunks_beside_decode_rows(models, name):
    """Chunked prefill: the second chunk continues from the slot's state (the convolution's
    last inputs, the delta rule's state) in a batch that also decodes other sequences and
    starts a new one."""
    build, hf = models(name)
    long_prompt, short, fresh = prompts(1, (75, 6, 9))
    want_long = transformers_greedy(hf, long_prompt, 0)[1][0]
    short_tokens, short_logits = transformers_greedy(hf, short, 1)
    want_fresh = transformers_greedy(hf, fresh, 0)[1][0]
    steps = HybridSteps(build(), 3)
    first = steps.step([(0, long_prompt[:40]), (1, short)])
    assert_logits_close(first[:40], want_long[:40])
    second = steps.step([(1, short_tokens), (0, long_prompt[40:]), (2, fresh)])
    assert_logits_close(second[0], short_logits[1][0])
    assert_logits_close(second[1:36], want_long[40:])
    assert_logits_close(second[36:], want_fresh)


@pytest.mark.parametrize("name", ["next_tied_attention_first", "qwen3.5_one_value_head_a_key"])
def test_a_step_of_one_token_prompts_starts_them_from_zeros(models, name):
    """A batch of one-token prompts is a step of one token a sequence (the decode kernels)
    whose sequences start: their slots' old contents (garbage here) are not read."""
    build, hf = models(name)
    batch = [[17], [400], [33]]
    expected = [transformers_greedy(hf, p, 2) for p in batch]
    steps = HybridSteps(build(), len(batch))
    rows = steps.step(list(enumerate(batch)))
    for step in range(3):
        for seq, (_, want) in enumerate(expected):
            assert_logits_close(rows[seq], want[step][-1])
        if step < 2:
            rows = steps.step([(seq, [tokens[step]]) for seq, (tokens, _) in
                               enumerate(expected)])
