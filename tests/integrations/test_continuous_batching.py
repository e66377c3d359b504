"""transformers' continuous-batching API (generate_batch, init_continuous_batching and its
manager, the context manager) served by the engine, against stock transformers' own
continuous batching on the same checkpoint (it runs on CPU; a small cache config keeps it
fast): the same request ids, tokens, statuses, streamed partial outputs and log-probabilities,
and the manager's behaviour where stock has nothing to compare (cancellation freeing blocks,
invalid requests failing alone)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, RequestStatus

import hf_paged
from tests.integrations.conftest import SMALL

PROMPTS = [[5, 60, 7, 80, 9], [11, 12, 13], list(range(3, 40)), [200 + i for i in range(16)]]
STOCK_CB = dict(num_blocks=16, max_batch_tokens=256)  # stock's cache sized for the tests


def _greedy(**kwargs) -> GenerationConfig:
    return GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False,
                            **kwargs)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)
    yield model
    model.close()


@pytest.fixture
def manager(model):
    manager = model.init_continuous_batching(_greedy())
    manager.start()
    yield manager
    manager.stop(block=True, timeout=10)
    assert not manager.is_running()


def _collect(manager, request_ids, timeout: float = 30.0) -> dict:
    """Each request's finished output, read from the shared queue as generate_batch does."""
    results, deadline = {}, time.monotonic() + timeout
    while set(request_ids) - set(results) and time.monotonic() < deadline:
        out = manager.get_result(timeout=0.5)
        if out is not None and out.is_finished():
            results[out.request_id] = out
    return results


def _stock_tokens(stock_model, prompt, n) -> list[int]:
    out = stock_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _slow_steps(model, monkeypatch, seconds: float = 0.003) -> None:
    """A few ms a step, so that what the test does lands mid-generation."""
    step = model.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(model.engine, "step", slow_step)


def test_is_transformers_manager(model):
    manager = model.init_continuous_batching()
    assert isinstance(manager, ContinuousBatchingManager)
    assert manager.generation_config is model.generation_config


@pytest.mark.parametrize("record_timestamps", [False, True])
def test_generate_batch_matches_stock(model, stock_model, record_timestamps):
    kwargs = dict(generation_config=_greedy(), max_new_tokens=9,
                  record_timestamps=record_timestamps)
    mine = model.generate_batch(PROMPTS, **kwargs)
    theirs = stock_model.generate_batch(
        PROMPTS, continuous_batching_config=ContinuousBatchingConfig(**STOCK_CB), **kwargs)
    assert list(mine) == list(theirs) == ["req_0", "req_1", "req_2", "req_3"]
    for request_id, ours in mine.items():
        ref = theirs[request_id]
        assert ours.request_id == ref.request_id
        assert ours.prompt_ids == ref.prompt_ids
        assert ours.generated_tokens == ref.generated_tokens
        assert ours.status == ref.status == RequestStatus.FINISHED
        assert ours.error is ref.error is None
        assert ours.logprobs == ref.logprobs == []
        assert ours.created_time <= ours.lifespan[0] <= ours.lifespan[1]
        if record_timestamps:
            assert len(ours.timestamps) == len(ours.generated_tokens) == len(ref.timestamps)
            assert ours.timestamps == sorted(ours.timestamps)
        else:
            assert ours.timestamps is ref.timestamps is None


def test_generate_batch_under_preemption_and_chunked_prefill(tiny_checkpoint, stock_model):
    """A cache too small for every request at once, prefill in 16-token chunks: the engine
    preempts and recomputes; the tokens stay stock generate()'s."""
    with hf_paged.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint, **dict(SMALL, num_kv_blocks=12, max_num_batched_tokens=16)) as small:
        out = small.generate_batch(PROMPTS, generation_config=_greedy(), max_new_tokens=12)
        assert small.engine.stats()["num_preemptions"] > 0
    for prompt, result in zip(PROMPTS, out.values()):
        assert result.generated_tokens == _stock_tokens(stock_model, prompt, 12)


def test_streaming_matches_stock(model, stock_model):
    """request_id_iter: one partial output per token (DECODING), then the finished one,
    with log-probabilities of the processed scores, as stock's manager delivers them."""
    def stream(source, **cb_options):
        manager = source.init_continuous_batching(
            _greedy(), ContinuousBatchingConfig(return_logprobs=True, **cb_options))
        manager.start()
        try:
            request_id = manager.add_request(PROMPTS[0], max_new_tokens=6, streaming=True)
            return [(o.status, o.generated_tokens, o.logprobs)
                    for o in manager.request_id_iter(request_id)]
        finally:
            manager.stop(block=True)

    mine, theirs = stream(model), stream(stock_model, **STOCK_CB)
    assert [s for s, _, _ in mine] == [RequestStatus.DECODING] * 5 + [RequestStatus.FINISHED]
    assert [(s, t) for s, t, _ in mine] == [(s, t) for s, t, _ in theirs]
    for (_, _, ours), (_, _, ref) in zip(mine, theirs):
        assert ours == pytest.approx(ref, abs=1e-4)


def test_manager_per_request_lengths_and_eos(manager, stock_model):
    ids = [manager.add_request(PROMPTS[0], max_new_tokens=3),
           manager.add_request(PROMPTS[1], request_id="mine", max_new_tokens=7)]
    free = _stock_tokens(stock_model, PROMPTS[2], 6)
    # an EOS of this request's own: it stops at that token, keeping it
    ids.append(manager.add_request(PROMPTS[2], max_new_tokens=6, eos_token_id=[free[2]]))
    assert ids[1] == "mine"
    results = _collect(manager, ids)
    assert results[ids[0]].generated_tokens == _stock_tokens(stock_model, PROMPTS[0], 3)
    assert results["mine"].generated_tokens == _stock_tokens(stock_model, PROMPTS[1], 7)
    assert results[ids[2]].generated_tokens == free[:3]


def test_cancel_frees_blocks_mid_generation(model, manager, monkeypatch):
    start = model.engine.stats()["num_free_blocks"]
    _slow_steps(model, monkeypatch)
    request_id = manager.add_request(PROMPTS[2], max_new_tokens=80, streaming=True,
                                     eos_token_id=-1)
    partial = next(manager.request_id_iter(request_id))
    assert partial.status == RequestStatus.DECODING
    assert model.engine.stats()["num_free_blocks"] < start
    manager.cancel_request(request_id)
    deadline = time.monotonic() + 5
    while model.engine.stats()["num_free_blocks"] != start and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.engine.stats()["num_free_blocks"] == start  # freed while the manager runs
    seen = []
    while (out := manager.get_result(timeout=0.2)) is not None:
        seen.append(out)
    assert all(not o.is_finished() and len(o.generated_tokens) < 80 for o in seen)
    # the manager goes on
    again = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert _collect(manager, [again])[again].status == RequestStatus.FINISHED


def test_invalid_requests_fail_alone(model, stock_model):
    config = ContinuousBatchingConfig(per_request_processors=True)
    gen = GenerationConfig(eos_token_id=2, pad_token_id=0, do_sample=True, top_p=0.9)
    manager = model.init_continuous_batching(gen, config)
    manager.start()
    try:
        ids = {
            "long": manager.add_request(list(range(3, 203)), max_new_tokens=4),
            "top_p": manager.add_request(PROMPTS[0], max_new_tokens=4, top_p=1.5),
            "unknown": manager.add_request(PROMPTS[0], max_new_tokens=4, foo=1),
            "max_new_tokens": manager.add_request(PROMPTS[0], max_new_tokens=500),
            "ok": manager.add_request(PROMPTS[1], max_new_tokens=5, top_p=0.5),
        }
        results = _collect(manager, ids.values())
        assert manager.is_running()
        assert manager.background_thread_status.fatal_error is None
    finally:
        manager.stop(block=True)
    for name in ("long", "top_p", "unknown", "max_new_tokens"):
        failed = results[ids[name]]
        assert failed.status == RequestStatus.FAILED and failed.generated_tokens == []
        assert name.replace("long", "prompt of 200 tokens").replace("unknown", "foo") \
            in failed.error
    ok = results[ids["ok"]]
    assert ok.status == RequestStatus.FINISHED and ok.error is None
    assert 1 <= len(ok.generated_tokens) <= 5
    assert model.engine.stats()["num_running"] == 0


def test_stop_refuses_new_requests(model):
    manager = model.init_continuous_batching(_greedy())
    manager.start()
    request_id = manager.add_request(PROMPTS[0], max_new_tokens=3)
    manager.stop(block=True)  # flushes what was queued
    assert not manager.is_running()
    assert _collect(manager, [request_id], timeout=1)[request_id].status == RequestStatus.FINISHED
    assert manager.add_request(PROMPTS[0], max_new_tokens=3) is None  # as transformers


def test_context_manager_and_generate_after(model, stock_model):
    with model.continuous_batching_context_manager(generation_config=_greedy()) as manager:
        assert manager.is_running()
        ids = manager.add_requests(PROMPTS[:2], max_new_tokens=5)
        results = _collect(manager, ids)
    assert not manager.is_running()
    for prompt, request_id in zip(PROMPTS, ids):
        assert results[request_id].generated_tokens == _stock_tokens(stock_model, prompt, 5)
    # the engine is left idle for generate()
    out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False)
    assert out[0, 5:].tolist() == _stock_tokens(stock_model, PROMPTS[0], 5)


def test_one_running_manager_per_engine(model, manager):
    other = model.init_continuous_batching(_greedy())
    with pytest.raises(RuntimeError, match="another continuous batching manager"):
        other.start()


def test_persistent_manager(model):
    first = model.generate_batch(PROMPTS[:1], generation_config=_greedy(), max_new_tokens=3,
                                 persistent_manager=True)
    cached = model._cached_continuous_batching_manager
    second = model.generate_batch(PROMPTS[:1], generation_config=_greedy(), max_new_tokens=3,
                                  persistent_manager=True)
    assert model._cached_continuous_batching_manager is cached
    assert second["req_1"].generated_tokens == first["req_0"].generated_tokens
    model.destroy_cached_continuous_batching_manager()
    assert not hasattr(model, "_cached_continuous_batching_manager")


def test_sampling_requests(model):
    gen = GenerationConfig(eos_token_id=-1, pad_token_id=0, do_sample=True, temperature=0.7,
                           top_k=8, num_return_sequences=2)
    config = ContinuousBatchingConfig(per_request_processors=True, return_logprobs=True, seed=0)
    manager = model.init_continuous_batching(gen, config)
    manager.start()
    try:
        ids = [manager.add_request(PROMPTS[0], max_new_tokens=6),
               manager.add_request(PROMPTS[1], max_new_tokens=4, temperature=1.3, top_k=2)]
        names = [ids[0], f"{ids[0]}__child#0", ids[1], f"{ids[1]}__child#0"]
        results = _collect(manager, names)
    finally:
        manager.stop(block=True)
    assert sorted(results) == sorted(names)
    for name, n in zip(names, (6, 6, 4, 4)):
        out = results[name]
        assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == n
        assert len(out.logprobs) == n and all(-30 < lp <= 0 for lp in out.logprobs)
    # top_k=2 for the second request: only the two most likely first tokens can be drawn
    logits = model(torch.tensor([PROMPTS[1]])).logits[0, -1]
    top2 = set(logits.topk(2).indices.tolist())
    assert {results[n].generated_tokens[0] for n in names[2:]} <= top2


def test_register_result_handler(model, manager):
    """transformers serve's non-streaming path: a handler resolving a future on the loop."""
    async def serve_one():
        future = asyncio.get_running_loop().create_future()
        manager.register_result_handler("chat-1", lambda out: future.done()
                                        or future.set_result(out))
        manager.add_request(PROMPTS[0], request_id="chat-1", max_new_tokens=4,
                            streaming=False, eos_token_id=2)
        return await asyncio.wait_for(future, timeout=30)

    out = asyncio.run(serve_one())
    assert out.request_id == "chat-1" and out.status == RequestStatus.FINISHED
    assert len(out.generated_tokens) == 4 or out.generated_tokens[-1] == 2


@pytest.mark.skipif(not hasattr(ContinuousBatchingManager, "pause"),
                    reason="ContinuousBatchingManager.pause is newer than this transformers")
def test_pause_hands_the_model_over(model, manager, stock_model, monkeypatch):
    _slow_steps(model, monkeypatch)
    request_id = manager.add_request(PROMPTS[2], max_new_tokens=40, streaming=True,
                                     eos_token_id=-1)
    assert next(manager.request_id_iter(request_id)).status == RequestStatus.DECODING
    with manager.pause():  # this thread may use the model meanwhile
        out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False)
    assert out[0, 5:].tolist() == _stock_tokens(stock_model, PROMPTS[0], 5)
    done = [o for o in manager.request_id_iter(request_id) if o.is_finished()]
    expected = stock_model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=40,
                                    do_sample=False, eos_token_id=None)[0, len(PROMPTS[2]):]
    assert done[0].generated_tokens == expected.tolist()


def test_hard_stop_fails_what_runs(model, monkeypatch):
    start = model.engine.stats()["num_free_blocks"]
    _slow_steps(model, monkeypatch)
    manager = model.init_continuous_batching(_greedy())
    manager.start()
    request_id = manager.add_request(PROMPTS[2], max_new_tokens=80, eos_token_id=-1,
                                     streaming=True)
    next(manager.request_id_iter(request_id))
    manager.stop(block=True, hard_stop=True)
    outputs = []
    while (out := manager.get_result()) is not None:
        outputs.append(out)
    assert outputs[-1].status == RequestStatus.FAILED
    assert "Generation loop finished before this request completed" in outputs[-1].error
    assert model.engine.stats()["num_free_blocks"] == start
    assert model.engine.in_flight is None


def test_failed_step_fails_its_requests_only(model, manager, monkeypatch):
    launch = model.engine.executor.launch
    calls = []

    def failing_launch(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("device fault in this step")
        return launch(batch)

    monkeypatch.setattr(model.engine.executor, "launch", failing_launch)
    first = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert _collect(manager, [first])[first].error == "device fault in this step"
    again = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert _collect(manager, [again])[again].status == RequestStatus.FINISHED
    assert manager.background_thread_status.fatal_error is None


def test_broken_engine_is_fatal(model, monkeypatch):
    manager = model.init_continuous_batching(_greedy())
    manager.start()

    def broken_launch(batch):
        model.engine.executor.broken = "rank 1 died"
        raise RuntimeError("rank 1 died")

    monkeypatch.setattr(model.engine.executor, "launch", broken_launch)
    monkeypatch.setattr(model.engine.executor, "broken", None)
    request_id = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert _collect(manager, [request_id])[request_id].error == "rank 1 died"
    manager.join(time.perf_counter(), timeout=5)
    assert not manager.is_running()
    assert str(manager.background_thread_status.fatal_error) == "rank 1 died"
    assert manager.add_request(PROMPTS[0], max_new_tokens=4) is None
    manager.stop(block=True)
