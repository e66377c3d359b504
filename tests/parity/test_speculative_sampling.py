"""Sampled speculative decoding keeps plain sampling's distribution: the joint distribution of
three sampled tokens, over many requests whose drafts are accepted or not, against the exact
one computed from transformers' logits and warpers (float32, CPU)."""

from __future__ import annotations

import math

import torch

from hf_paged.engine.engine import EngineCore
from hf_paged.sampling_params import SamplingParams, Speculation
from tests.parity.test_speculative import Scripted, repeating

SETTINGS = dict(temperature=1.0, top_k=4, top_p=0.9)
N = 1500


def next_token_probs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' processed next-token distribution after ``tokens``."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()
    config, _ = model._prepare_generation_config(None, do_sample=True, **SETTINGS)
    model._prepare_special_tokens(config, False, device="cpu", batch_size=1)
    warp = model._get_logits_processor(config, ids.shape[1], logits_processor=[])
    return warp(ids, logits).softmax(-1)[0]


def exact_joint(model, prompt: list[int], steps: int) -> dict[tuple[int, ...], float]:
    """Every continuation of ``steps`` tokens with its probability under plain sampling."""
    joint = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for prefix, p in joint.items():
            probs = next_token_probs(model, prompt + list(prefix))
            for token in probs.nonzero()[:, 0].tolist():
                grown[prefix + (token,)] = p * probs[token].item()
        joint = grown
    return joint


def test_sampled_verification_keeps_the_distribution(checkpoints, hf_models):
    prompt = repeating(1, 1000, seed=11)[0]
    greedy = EngineCore.from_pretrained(checkpoints["gqa_tied"], block_size=8).generate_tokens(
        [prompt], SamplingParams(max_new_tokens=3))[0]
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_num_seqs=256,
                                        speculative_max_batch=256)
    proposer = Scripted({})  # drafts: the greedy continuation, right as often as sampling is
    spec = Speculation(proposer, num_tokens=2)
    torch.manual_seed(0)
    seqs = [engine.add_request(prompt, SamplingParams(max_new_tokens=3, speculation=spec,
                                                      **SETTINGS)) for _ in range(N)]
    proposer.continuations = {s.request_id: prompt + greedy for s in seqs}
    engine.run(seqs)
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        key = tuple(seq.output_token_ids)
        counts[key] = counts.get(key, 0) + 1
    joint = exact_joint(hf_models["gqa_tied"], prompt, 3)
    assert set(counts) <= set(joint), "a continuation plain sampling never draws"
    chi2, dof = 0.0, -1
    for key, p in joint.items():
        freq = counts.get(key, 0) / N
        assert abs(freq - p) <= 4.5 * math.sqrt(p * (1 - p) / N) + 0.005, (key, freq, p)
        if N * p >= 5:
            chi2 += (counts.get(key, 0) - N * p) ** 2 / (N * p)
            dof += 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 6, chi2
