"""Outputs of a continuous-batching manager to its ``OutputRouter``, with no more than one
partial output of a stream waiting for its result handler at a time.

A streamed request's partial outputs share the request's token list (``EngineLoop._partial``;
``RemoteManager``'s one list a request): a handler reads the tokens past those it has seen,
so an output still waiting on the handler's event loop already carries every token appended
since it was delivered. While one waits (the event loop lags behind the steps), another for
the same request would find nothing new: ``OutputDelivery.waiting`` tells the producer to
skip it, which saves the loop a callback, a streamer call and the output itself per stream
and step exactly when it is busiest. A request's last output is always delivered.
"""

from __future__ import annotations

from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput


class OutputDelivery:
    """transformers' ``OutputRouter.deliver_batch`` (the outputs a handler reads: one
    ``call_soon_threadsafe`` a batch; the others: the router's queue), remembering which
    requests have an output not yet handed to their handler."""

    def __init__(self, router: OutputRouter):
        self.router = router
        self._unread: set[str] = set()  # request ids with an output not yet handled

    def waiting(self, request_id: str) -> bool:
        """Whether an output of ``request_id`` is on its way to the request's handler (set
        before it was delivered; the handler's thread clears it before the handler reads)."""
        return request_id in self._unread

    def deliver(self, outputs: list[GenerationOutput]) -> None:
        calls = []
        loop = None
        router = self.router
        with router._lock:
            for output in outputs:
                entry = router.result_handlers.get(output.request_id)
                if entry is None:
                    router.output_queue.put(output)
                else:
                    callback, loop = entry
                    calls.append((callback, output))
                    self._unread.add(output.request_id)
        if calls:
            loop.call_soon_threadsafe(self._run, calls)

    def _run(self, calls: list) -> None:
        for callback, output in calls:
            # Cleared first: tokens appended after this reads as waiting are read below.
            self._unread.discard(output.request_id)
            callback(output)
