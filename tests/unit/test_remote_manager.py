"""The server side of ``hf-paged serve --engine-process``: outputs arriving from the engine
process for requests the event loop has cancelled meanwhile are dropped, not an error (an
error there ended the receiving thread, and every stream after it hung)."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_paged.integrations.remote_manager import RemoteManager


def manager() -> RemoteManager:
    model = SimpleNamespace(processes=[SimpleNamespace(thread=None)], engine=None)
    return RemoteManager(model, GenerationConfig(), None)


def test_a_request_cancelled_while_its_last_output_is_handled():
    remote = manager()
    delivered = []
    remote.delivery.deliver = delivered.extend
    remote.tokens["a"] = [1]
    remote.tokens["b"] = []
    # "a" finishes in the batch while the event loop cancels it between its lookup and its
    # removal: here, before the message is handled at all; and "b" goes on.
    outputs = [("a", [2], RequestStatus.FINISHED, None), ("b", [7], RequestStatus.DECODING, None)]
    real_tokens = remote.tokens

    class CancelledOnLookup(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if key == "a":
                self.pop("a")  # cancel_request on the event loop
            return value

    remote.tokens = CancelledOnLookup(real_tokens)
    remote.on_message(0, ("out", outputs))
    assert [o.request_id for o in delivered] == ["a", "b"]
    assert delivered[0].generated_tokens == [1, 2] and "a" not in remote.tokens
    assert remote.tokens["b"] == [7]
