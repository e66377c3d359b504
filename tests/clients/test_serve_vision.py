"""hf-paged serve of a Qwen3.5 vision-language release (``Qwen3_5ForConditionalGeneration``'s
layout, tiny, random, float32 on CPU; transformers' server would load it as a multimodal
model): its text model on hf_paged's engine, in this process and in an engine process, with
continuous batching; greedy chat text as stock transformers' causal LM generates it, and a
request with an image part refused by name, the server serving on."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_paged.integrations.serve_options import FrontOptions
from hf_paged.integrations.serve_vision import media_part
from hf_paged.random_checkpoint import make_checkpoint
from tests.clients.serve_helpers import ask, in_process_server
from tests.conftest import SMALL

MESSAGES = [{"role": "user", "content": "The river runs"}]
NEW_TOKENS = 6
IMAGE = [{"role": "user", "content": [
    {"type": "text", "text": "What is this?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
MODES = {"one_process": FrontOptions(), "engine_process": FrontOptions(engine_process=True)}


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> str:
    """The tiny release with its tokenizer (and no image processor: none can load here)."""
    return make_checkpoint("tiny-qwen3.5-vl", str(tmp_path_factory.mktemp("vl_tok")),
                           dtype="float32")


@pytest.fixture(scope="module")
def expected(release) -> dict:
    """Stock transformers' greedy answer to ``MESSAGES``, as ``ask`` reads a chat response:
    its causal LM (the release's text model) generating from the chat template's tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(release)
    model = transformers.AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    prompt = inputs["input_ids"].shape[1]
    new = model.eval().generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt:]
    finish = "length" if len(new) == NEW_TOKENS else "stop"
    return {"choices": [(tokenizer.decode(new, skip_special_tokens=True), None, finish)],
            "usage": (prompt, len(new))}


@pytest.mark.parametrize("mode", list(MODES))
def test_text_served_on_hf_paged_and_images_refused(release, expected, mode):
    with in_process_server(release, True, front=MODES[mode], **SMALL) as (url, _):
        text = dict(model=release, messages=MESSAGES, max_tokens=NEW_TOKENS)
        assert ask(url, "chat", **text) == expected
        refused = ask(url, "chat", model=release, messages=IMAGE, max_tokens=NEW_TOKENS)
        assert refused["status"] == 400, refused
        assert refused["error"]["message"].startswith(
            "messages[0].content[1] is a part of type 'image_url': "), refused
        assert ask(url, "chat", stream=True, **text) == expected


def test_media_part_named():
    assert media_part({"messages": MESSAGES}) is None
    assert media_part({"messages": IMAGE}) == "messages[0].content[1] is a part of type 'image_url'"
    responses = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}, {"type": "input_audio", "input_audio": {}}]}]}
    assert media_part(responses) == "input[0].content[1] is a part of type 'input_audio'"
    assert media_part({"input": "Hi"}) is None
