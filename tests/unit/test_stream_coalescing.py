"""A lagging stream's tokens travel together: ``OutputDelivery`` hands a stream no second
partial output while its last one waits for the handler's loop (the waiting one shares the
token list, so it carries the later tokens too), and ``serve_stream.coalesce`` joins the texts
put while the one before waits unread. A reader that keeps up sees one output and one text a
put; the text, joined, is the same."""

from __future__ import annotations

import asyncio

from transformers.cli.serving.utils import ReasoningText
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from hf_paged.integrations.output_delivery import OutputDelivery
from hf_paged.integrations.serve_stream import coalesce


class Loop:
    """An event loop that runs what it was handed only when told."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, function, *args) -> None:
        self.calls.append((function, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for function, args in calls:
            function(*args)


def test_no_second_output_while_one_waits():
    router, loop, seen = OutputRouter(), Loop(), []
    router.result_handlers["s"] = (lambda out: seen.append(list(out.generated_tokens)), loop)
    delivery = OutputDelivery(router)
    tokens = [1]
    delivery.deliver([GenerationOutput("s", generated_tokens=tokens)])
    assert delivery.waiting("s")
    tokens.append(2)  # the next step: the producer skips its output, the list grows
    loop.run()
    assert seen == [[1, 2]] and not delivery.waiting("s")
    tokens.append(3)
    delivery.deliver([GenerationOutput("s", generated_tokens=tokens),
                      GenerationOutput("q", generated_tokens=[9])])  # no handler: the queue
    loop.run()
    assert seen == [[1, 2], [1, 2, 3]]
    assert router.output_queue.get_nowait().generated_tokens == [9]
    assert not delivery.waiting("q")


def test_the_remote_manager_skips_a_waiting_streams_update_but_not_its_last():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hf_paged.integrations.remote_manager import RemoteManager

    model = SimpleNamespace(processes=[SimpleNamespace(thread=None)], engine=None)
    remote = RemoteManager(model, GenerationConfig(), None)
    loop, seen = Loop(), []
    remote.output_router.result_handlers["s"] = (seen.append, loop)
    remote.tokens["s"] = []
    remote.on_message(0, ("out", [("s", [1], RequestStatus.DECODING, None)]))
    remote.on_message(0, ("out", [("s", [2], RequestStatus.DECODING, None)]))
    remote.on_message(0, ("out", [("s", [3], RequestStatus.FINISHED, None)]))
    loop.run()
    assert [(o.generated_tokens, o.status) for o in seen] == [
        ([1, 2, 3], RequestStatus.DECODING), ([1, 2, 3], RequestStatus.FINISHED)]


def test_coalesce_joins_only_unread_texts_of_one_kind():
    async def main() -> list:
        queue = coalesce(asyncio.Queue())
        got = []
        queue.put_nowait("a")
        queue.put_nowait("b")  # "a" unread: joined
        got.append(await queue.get())
        queue.put_nowait("c")  # nothing unread: alone
        got.append(await queue.get())
        for item in ("d", ReasoningText("r1"), ReasoningText("r2"), "e", None, "f"):
            queue.put_nowait(item)
        while not queue.empty():
            got.append(queue.get_nowait())
        return got

    got = asyncio.run(main())
    assert got == ["ab", "c", "d", "r1r2", "e", None, "f"]
    assert [type(item) for item in got[3:5]] == [ReasoningText, str]


def test_a_request_starts_no_timer_thread_and_an_idle_model_still_unloads():
    """``cheap_idle_timer``: transformers' ``TimedModel`` unloads a model its timeout after the
    last request, as before, without a thread started a request; never, with no timeout."""
    import threading
    import time
    from types import SimpleNamespace

    from transformers.cli.serving.model_manager import TimedModel

    from hf_paged.integrations.serve_stream import cheap_idle_timer

    stock = TimedModel.reset_timer
    restore = cheap_idle_timer()
    try:
        unloaded = []
        forced = TimedModel(SimpleNamespace(name_or_path="forced"), timeout_seconds=-1)
        model = TimedModel(SimpleNamespace(name_or_path="m"), timeout_seconds=0.3,
                           on_unload=lambda: unloaded.append(time.monotonic()))
        threads = threading.active_count()
        for _ in range(50):
            forced.reset_timer()
            model.reset_timer()
        assert threading.active_count() <= threads + 1
        time.sleep(0.15)
        last = time.monotonic()
        model.reset_timer()
        time.sleep(0.2)
        assert not unloaded and model.model is not None  # 0.35 s old, 0.2 s idle
        deadline = time.monotonic() + 5
        while not unloaded and time.monotonic() < deadline:
            time.sleep(0.02)
        assert unloaded and unloaded[0] - last >= 0.3 and model.model is None
        assert forced.model is not None
    finally:
        restore()
    assert TimedModel.reset_timer is stock
