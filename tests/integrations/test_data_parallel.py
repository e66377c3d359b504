"""``data_parallel_size=2``: one model object, its ``generate`` spread over two replica
processes; the same tokens as one engine, both replicas used, a killed replica failing its
own call by name while the other serves on. One replicated model for the module (two
processes to start); the test that kills a replica runs last."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import hf_paged
from tests.conftest import FLOAT32_RTOL, left_padded

# Long enough (max_model_len) for a call to be still running when its replica is killed.
OPTIONS = dict(dtype=torch.float32, device_map="cpu", max_model_len=1024, num_kv_blocks=512,
               block_size=8)


@pytest.fixture(scope="module")
def single(tiny_checkpoint):
    with hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **OPTIONS) as model:
        yield model


@pytest.fixture(scope="module")
def replicated(tiny_checkpoint):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, data_parallel_size=2,
                                                          **OPTIONS)
    processes = [r.process.process for r in model.engine.replicas]
    yield model
    model.close()
    assert all(p.poll() is not None for p in processes)  # reaped: none left behind
    assert not any(os.path.exists(f"/proc/{p.pid}") for p in processes)


def test_greedy_rows_and_beams_as_one_engine(single, replicated):
    ids, mask = left_padded([5, 3, 7, 2, 6], single.config.vocab_size)
    greedy = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert type(replicated).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(replicated.generate(ids, **greedy), single.generate(ids, **greedy))
    # a row's beams on one replica
    beams = dict(greedy, attention_mask=mask[:3], num_beams=2, num_return_sequences=2)
    assert torch.equal(replicated.generate(ids[:3], **beams), single.generate(ids[:3], **beams))


def test_requests_reach_both_replicas(single, replicated):
    before = [r["served"] for r in replicated.engine.stats()["replicas"]]
    ids, mask = left_padded([4, 4, 4, 4], replicated.config.vocab_size, seed=1)
    replicated.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    stats = replicated.engine.stats()
    served = [r["served"] - b for r, b in zip(stats["replicas"], before)]
    assert served == [2, 2]  # least-loaded dealing: an idle pair shares a call evenly
    # by tokens, heaviest first: 20 + 4 on one replica; 5 + 4, 3 + 4, 2 + 4 on the other
    prompts = [[5] * n for n in (20, 5, 3, 2)]
    params = hf_paged.SamplingParams(max_new_tokens=4, temperature=0.0)
    before = [r["served"] for r in replicated.engine.stats()["replicas"]]
    outputs = replicated.engine.generate_tokens(prompts, params)
    assert outputs == single.engine.generate_tokens(prompts, params)
    served = [r["served"] - b for r, b in zip(replicated.engine.stats()["replicas"], before)]
    assert served == [1, 3]
    assert stats["num_blocks"] == sum(r["num_blocks"] for r in stats["replicas"])
    assert all(r["outstanding"] == 0 for r in stats["replicas"])


def test_the_generation_config_set_here_is_the_replicas(single, replicated):
    ids, mask = left_padded([5, 3], single.config.vocab_size, seed=3)
    for model in (single, replicated):
        model.generation_config.max_new_tokens = 5
        model.generation_config.do_sample = False
    try:
        out = replicated.generate(ids, attention_mask=mask)
        assert out.shape[1] <= ids.shape[1] + 5
        assert torch.equal(out, single.generate(ids, attention_mask=mask))
    finally:
        for model in (single, replicated):
            model.generation_config.max_new_tokens = None


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_data_parallel_size_is_refused_by_name(tiny_checkpoint, value):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, data_parallel_size=value,
                                                      **OPTIONS)


def test_one_engine_is_one_replica(tiny_checkpoint):
    with pytest.raises(ValueError, match="data_parallel_size > 1: one engine is one replica"):
        hf_paged.PagedEngine.from_pretrained(tiny_checkpoint, data_parallel_size=2)


def test_what_cannot_cross_to_a_replica_is_refused_by_name(replicated):
    ids, _ = left_padded([3], replicated.config.vocab_size)
    with pytest.raises(ValueError, match="streamer is not supported with data_parallel_size"):
        replicated.generate(ids, streamer=object(), max_new_tokens=2)


def test_the_model_call_spreads_its_rows_over_the_replicas(single, replicated):
    """Logits (with labels' loss and ``logits_to_keep``) and the inner model's hidden states
    (every layer's too) as one engine's, the rows dealt to both replicas and put back in
    order."""
    ids, mask = left_padded([3, 17, 9, 30, 5], replicated.config.vocab_size, seed=8)
    served = [r.served for r in replicated.engine.replicas]
    with torch.no_grad():
        for kwargs in (dict(labels=ids), dict(logits_to_keep=2, output_hidden_states=True)):
            ours = replicated(ids, attention_mask=mask, **kwargs)
            theirs = single(ids, attention_mask=mask, **kwargs)
            torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=FLOAT32_RTOL)
            if "labels" in kwargs:
                torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-6, rtol=FLOAT32_RTOL)
            else:
                torch.testing.assert_close(ours.hidden_states, theirs.hidden_states,
                                           atol=1e-5, rtol=FLOAT32_RTOL)
        ours = replicated.model(ids, attention_mask=mask, output_hidden_states=True)
        theirs = single.model(ids, attention_mask=mask, output_hidden_states=True)
        torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state,
                                   atol=1e-5, rtol=FLOAT32_RTOL)
        torch.testing.assert_close(ours.hidden_states, theirs.hidden_states,
                                   atol=1e-5, rtol=FLOAT32_RTOL)
    assert all(r.served > s for r, s in zip(replicated.engine.replicas, served))


def test_a_killed_replica_fails_its_own_call_and_the_other_serves_on(single, replicated):
    front = replicated.engine
    victim = front.replicas[1].process.process
    ids, mask = left_padded([4, 6], replicated.config.vocab_size, seed=2)
    results: dict[str, object] = {}

    def call(name: str, row: int, tokens: int) -> None:
        try:
            results[name] = replicated.generate(ids[row:row + 1], attention_mask=mask[row:row + 1],
                                                max_new_tokens=tokens, min_new_tokens=tokens,
                                                do_sample=False)
        except Exception as error:
            results[name] = error

    short = threading.Thread(target=call, args=("short", 0, 200))
    short.start()
    _until(lambda: front.replicas[0].outstanding > 0)  # the next call goes to replica 1
    long = threading.Thread(target=call, args=("long", 1, 1000))
    long.start()
    _until(lambda: front.replicas[1].outstanding > 0
           and front.replicas[1].process.call("stats")[0]["num_running"] == 1)
    os.kill(victim.pid, signal.SIGKILL)
    short.join(60)
    long.join(60)
    assert isinstance(results["long"], RuntimeError)
    assert str(results["long"]) == (f"data-parallel replica 1 (pid {victim.pid}) exited "
                                    f"(code {-signal.SIGKILL})")
    greedy = dict(attention_mask=mask[:1], max_new_tokens=200, min_new_tokens=200,
                  do_sample=False)
    assert torch.equal(results["short"], single.generate(ids[:1], **greedy))
    # later calls: every row on the live replica, the dead one's death in the stats
    later = replicated.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(later, single.generate(ids, attention_mask=mask, max_new_tokens=5,
                                              do_sample=False))
    stats = front.stats()["replicas"]
    assert stats[1]["died"] == str(results["long"]) and "num_blocks" not in stats[1]


def _until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
