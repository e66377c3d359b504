"""The speculation benchmark's checkpoints do what it claims: greedy decoding walks the
target's permutation, and a draft agrees with the target on all but the chosen fraction of
the tokens (``benchmarks.known_acceptance``)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import known_acceptance as known

SPEC = known.CycleSpec(cycle_len=8, num_short=4, long_cycle_len=256)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[dict, dict[float, dict]]:
    return known.build_pair(tmp_path_factory.mktemp("spec"), "tiny", "tiny", [0.0, 0.3], SPEC,
                            "float32", "cpu")


def next_tokens(path: str) -> torch.Tensor:
    """The greedy next token after each single token of the vocabulary."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.arange(model.config.vocab_size)[:, None]).logits[:, -1].argmax(-1)


def test_greedy_generate_walks_the_permutation(pair):
    target, _ = pair
    model = AutoModelForCausalLM.from_pretrained(target["path"], dtype=torch.float32)
    for prompts in (known.random_prompts(target, 2, 12, seed=0),
                    known.repeating_prompts(target, 2, 12, seed=0)):
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
            assert out[0, 12:].tolist() == known.continuation(target["successor"], prompt, 20)
    # A repeating prompt walks its cycle for longer than the cycle: the continuation repeats it.
    prompt = known.repeating_prompts(target, 1, 12, seed=0)[0]
    assert (prompt + known.continuation(target["successor"], prompt, 8))[-8:] == prompt[-8:]


def test_each_model_follows_its_successor_and_the_draft_agrees_at_one_minus_f(pair):
    target, drafts = pair
    successor = torch.tensor(target["successor"])
    assert torch.equal(next_tokens(target["path"]), successor)
    special = set(target["special"])
    assert all(successor[t] == t for t in special)  # no walk reaches EOS
    for f, draft in drafts.items():
        drafted = next_tokens(draft["path"])
        assert torch.equal(drafted, torch.tensor(draft["successor"]))
        disagree = (drafted != successor).sum().item()
        assert disagree == round(f * (len(successor) - len(special)))


def test_checkpoints_are_reused_and_rebuilt_when_their_recipe_changes(tmp_path, capsys):
    build = partial(known.build_pair, tmp_path, "tiny", "tiny", [0.3])
    first, _ = build(SPEC, "float32", "cpu")
    again, _ = build(SPEC, "float32", "cpu")
    assert again["successor"] == first["successor"]
    assert capsys.readouterr().out.count("reusing") == 2
    other = known.CycleSpec(cycle_len=8, num_short=4, long_cycle_len=256, seed=1)
    rebuilt, drafts = build(other, "float32", "cpu")
    assert rebuilt["successor"] != first["successor"]
    assert drafts[0.3]["built_from"]["target"] == rebuilt["fingerprint"]
    assert capsys.readouterr().out.count("built") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft-tiny-f0.3", "target-tiny"]


def test_expected_tokens_per_step():
    assert known.tokens_per_step(1.0, 4) == 5.0
    assert known.tokens_per_step(0.0, 4) == 1.0
    assert known.tokens_per_step(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    for a in (0.1, 0.5, 0.7, 0.95):
        assert known.acceptance_for(known.tokens_per_step(a, 4) - 1, 4) == pytest.approx(a)
