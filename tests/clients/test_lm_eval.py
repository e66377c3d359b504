"""lm-evaluation-harness's ``HFLM`` over an hf_paged model gives the results it gives over
stock transformers: loglikelihoods, rolling loglikelihoods, and batched ``generate_until``
with stop sequences; the hybrid families' loglikelihoods too. hf_paged enters HFLM both ways
a user hands it a model: as the model object (also split over two ranks: gloo, a spawned
worker; and over two data-parallel replicas), and as a checkpoint path loaded under
``hf_paged.patch_transformers()``."""

from __future__ import annotations

import re

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

import hf_paged
from hf_paged.random_checkpoint import make_checkpoint
from tests.conftest import FLOAT32_RTOL, SMALL

# A window shorter than the rolling texts, so loglikelihood_rolling scores several windows.
LM_ARGS = dict(batch_size=4, max_length=48)

LOGLIKELIHOOD = [
    ("Once upon a time", " there was a cat"),
    ("The river starts", " in the mountains and runs to the sea"),
    ("What is two plus two?", " Four."),
    ("", "Hello world"),  # an empty context: scored after lm-eval's prefix token
    ("Numbers: 0 1 2", " 3"),
]
ROLLING = [
    "The river starts in the mountains. " * 12 + "It runs through the valley to the sea.",
    "Hello there, how are you today?",
]
# Six prompts of four token lengths: one full batch of 4, then a batch of 2.
PROMPTS = ["Once upon a time", "The river starts", "Numbers: 0 1 2 3", "a", "Hello",
           "The weather today"]
MAX_GEN_TOKS = 24


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    """Fresh requests each call: lm-eval edits a request's ``until`` list in place."""
    return [Instance(request_type=kind, doc={}, arguments=tuple(a), idx=i)
            for i, a in enumerate(arguments)]


def generation_requests(until: list[str]) -> list[Instance]:
    return requests("generate_until", [
        (p, {"until": list(until), "max_gen_toks": MAX_GEN_TOKS, "do_sample": False})
        for p in PROMPTS])


@pytest.fixture(scope="module")
def stock_lm(tiny_checkpoint):
    return HFLM(pretrained=tiny_checkpoint, dtype="float32", device="cpu", **LM_ARGS)


@pytest.fixture(scope="module", params=["model", "model_tp2", "model_dp2", "patched_path"])
def paged_lm(request, tiny_checkpoint):
    """HFLM over hf_paged, built inside each test (so that a failure to build it fails the
    test rather than erroring its set-up), once per module; its model closed at the end."""
    built = {}

    def build() -> HFLM:
        if "lm" not in built:
            built["lm"] = _paged_lm(request.param, tiny_checkpoint)
        return built["lm"]

    yield build
    if "lm" in built:
        built["lm"].model.close()


def _paged_lm(how: str, tiny_checkpoint) -> HFLM:
    if how.startswith("model"):
        split = {"model_tp2": dict(tensor_parallel_size=2),
                 "model_dp2": dict(data_parallel_size=2)}.get(how, {})
        model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL, **split)
        return HFLM(pretrained=model, tokenizer=tiny_checkpoint, **LM_ARGS)
    # HFLM passes its extra keywords on to from_pretrained: the engine options ride along.
    with hf_paged.patch_transformers():
        lm = HFLM(pretrained=tiny_checkpoint, dtype="float32", device="cpu", **LM_ARGS,
                  **SMALL)
    assert isinstance(lm.model, hf_paged.Qwen3ForCausalLM)
    return lm


@pytest.fixture(scope="module")
def stops(stock_lm) -> dict[str, list[str]]:
    """Stop sequences read off stock's greedy continuations of ``PROMPTS``, so they occur:
    ``words``, one word from the middle of each of three continuations (rows stop at
    different points), and ``shared``, a string every continuation holds, so that every row
    of a batch finishes and lm-eval's criteria end the batch's generation early."""
    free = stock_lm.generate_until(generation_requests([]), disable_tqdm=True)
    words = []
    for text in free[::2]:
        found = re.findall(r"[A-Za-z]{3,}", text)
        assert found, f"no word in the continuation {text!r}"
        words.append(found[len(found) // 2][:5])
    pairs = set.intersection(*({t[i:i + 2] for i in range(len(t) - 1)} for t in free))
    shared = sorted(p for p in pairs if p.isprintable() and not p.isspace())
    assert shared, "no two characters common to every continuation"
    return dict(free=free, words=words, shared=shared[:1])


def test_loglikelihood(stock_lm, paged_lm):
    expected = stock_lm.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), True)
    got = paged_lm().loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), True)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
    torch.testing.assert_close(torch.tensor([lp for lp, _ in got], dtype=torch.float64),
                               torch.tensor([lp for lp, _ in expected], dtype=torch.float64),
                               atol=1e-4, rtol=FLOAT32_RTOL)


def test_loglikelihood_rolling(stock_lm, paged_lm):
    arguments = [(text,) for text in ROLLING]
    assert len(stock_lm.tok_encode(ROLLING[0])) > 2 * LM_ARGS["max_length"]
    expected = stock_lm.loglikelihood_rolling(requests("loglikelihood_rolling", arguments), True)
    got = paged_lm().loglikelihood_rolling(requests("loglikelihood_rolling", arguments), True)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64),
                               atol=1e-4, rtol=FLOAT32_RTOL)


@pytest.mark.parametrize("which", ["words", "shared"])
def test_generate_until(stock_lm, paged_lm, stops, which):
    until = stops[which]
    expected = stock_lm.generate_until(generation_requests(until), disable_tqdm=True)
    # The stops occur: they cut stock's outputs short of the free-running continuations.
    cut = sum(len(e) < len(f) for e, f in zip(expected, stops["free"]))
    assert cut >= (3 if which == "words" else len(PROMPTS)), (until, expected)
    assert paged_lm().generate_until(generation_requests(until), disable_tqdm=True) == expected


@pytest.mark.parametrize("shape", ["tiny-next", "tiny-qwen3.5"])
def test_hybrid_loglikelihoods(tmp_path, shape):
    """Qwen3-Next and Qwen3.5 (linear-attention layers beside attention): lm-eval's padded
    batches score as over stock, the rolling windows too."""
    path = make_checkpoint(shape, str(tmp_path), dtype="float32")
    stock = HFLM(pretrained=path, dtype="float32", device="cpu", **LM_ARGS)
    with hf_paged.AutoModelForCausalLM.from_pretrained(path, **SMALL) as model:
        paged = HFLM(pretrained=model, tokenizer=path, **LM_ARGS)
        expected = stock.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), True)
        got = paged.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), True)
        rolling = [(text,) for text in ROLLING]
        expected_rolling = stock.loglikelihood_rolling(
            requests("loglikelihood_rolling", rolling), True)
        got_rolling = paged.loglikelihood_rolling(
            requests("loglikelihood_rolling", rolling), True)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in got] + got_rolling, dtype=torch.float64),
        torch.tensor([lp for lp, _ in expected] + expected_rolling, dtype=torch.float64),
        atol=1e-4, rtol=FLOAT32_RTOL)
