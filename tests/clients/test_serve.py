"""``hf-paged serve``: transformers' own ``transformers serve`` with the tiny Qwen3 checkpoint on
hf_paged, driven by the official openai client and compared with stock ``transformers serve``
on the same checkpoint (float32 on CPU; greedy, so the same tokens and the same text).

Three servers run as subprocesses on 127.0.0.1, started together: stock ``transformers serve``,
``python -m hf_paged serve`` (transformers' ``model.generate`` + streamer path) and ``python -m
hf_paged serve --continuous-batching`` (transformers' continuous-batching path, which calls
``model.init_continuous_batching``; tests of it carry ``continuous_batching`` in their ids). The
load test is test_serve_load.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import urllib.request
from pathlib import Path

import openai
import pytest

from hf_paged.cli import main
from hf_paged.integrations.patch import unpatch_transformers
from tests.clients.serve_helpers import (
    MODEL,
    ServerProcess,
    ask,
    client,
    hub_cache,
    server_env,
)
from tests.conftest import SMALL

MODES = ("generate", "continuous_batching")
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a river."},
    {"role": "assistant", "content": "The Nile."},
    {"role": "user", "content": "And a mountain?"},
]
SAMPLING = json.dumps({"do_sample": True, "top_k": 20})  # a request's own generation_config
# (endpoint, request): both servers get each one, streamed and not; stock's outcome is expected.
CASES = {
    "chat": ("chat", dict(messages=HELLO, max_tokens=12)),
    "chat_conversation": ("chat", dict(messages=CONVERSATION, max_tokens=10)),
    "chat_max_completion_tokens": ("chat", dict(messages=HELLO, max_completion_tokens=5)),
    "completion": ("completion", dict(prompt="Once upon a time", max_tokens=12)),
    "completion_suffix": ("completion", dict(prompt="The river", max_tokens=6, suffix=" END")),
    # transformers serve samples only when the checkpoint's (or the request's own)
    # generation_config says so: a temperature alone leaves greedy decoding, -1 included.
    "chat_temperature_0": ("chat", dict(messages=HELLO, max_tokens=12, temperature=0)),
    "chat_temperature_no_sampling": ("chat", dict(messages=HELLO, max_tokens=12,
                                                  temperature=0.7, top_p=0.5)),
    "chat_temperature_negative_no_sampling": ("chat", dict(messages=HELLO, max_tokens=8,
                                                           temperature=-1)),
    "chat_frequency_penalty": ("chat", dict(messages=HELLO, max_tokens=16,
                                            frequency_penalty=0.5)),
    "chat_logit_bias": ("chat", dict(messages=HELLO, max_tokens=6, logit_bias={"300": 50.0})),
    # transformers serve ignores n (one choice, a warning in its log)
    "chat_n": ("chat", dict(messages=HELLO, max_tokens=8, n=2)),
    "completion_n": ("completion", dict(prompt="Once upon a time", max_tokens=8, n=2)),
    "chat_unknown_field": ("chat", dict(messages=HELLO, max_tokens=4, extra_body={"bogus": 1})),
    "completion_unknown_field": ("completion", dict(prompt="Hi", extra_body={"bogus": 1})),
}
# What the continuous-batching path must match too: transformers' manager takes only the
# prompt, max_new_tokens and EOS of a request (stop strings, penalties, per-request sampling
# and their refusals are not passed on), so only these are the same request there.
CORE = ("chat", "chat_conversation", "chat_max_completion_tokens", "completion",
        "completion_suffix", "chat_temperature_0", "chat_temperature_no_sampling", "chat_n",
        "completion_n", "chat_unknown_field")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_checkpoint):
    """name -> ServerProcess: "stock", and hf_paged's in each of ``MODES``."""
    root = tmp_path_factory.mktemp("serve")
    env = server_env(hub_cache(root / "hub", tiny_checkpoint))
    common = [MODEL, "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    paged = [sys.executable, "-m", "hf_paged", "serve", *common,
                *(f"--engine-option={k}={v}" for k, v in SMALL.items())]
    argvs = {
        "stock": [sys.executable, "-m", "transformers.cli.transformers", "serve", *common],
        "generate": paged,
        "continuous_batching": [*paged, "--continuous-batching"],
    }
    started = {name: ServerProcess(argv, env, root / f"{name}.log") for name, argv in argvs.items()}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def stock(servers):
    """Stock's outcome of a request, asked once."""
    seen: dict[str, dict] = {}

    def outcome(endpoint: str, stream: bool = False, **request) -> dict:
        key = json.dumps([endpoint, stream, request], sort_keys=True)
        if key not in seen:
            seen[key] = ask(servers["stock"].url(), endpoint, stream, **request)
        return seen[key]

    return outcome


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode, case", [("generate", c) for c in CASES] +
                         [("continuous_batching", c) for c in CORE])
def test_same_response_as_stock(servers, stock, mode, case, stream):
    endpoint, request = CASES[case]
    expected = stock(endpoint, stream, **request)
    assert ask(servers[mode].url(), endpoint, stream, **request) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stop_strings(servers, stock, endpoint, stream):
    """A stop string taken from the middle of stock's greedy text ends both there."""
    request = dict(messages=HELLO) if endpoint == "chat" else dict(prompt="Once upon a time")
    text = stock(endpoint, **request, max_tokens=16)["choices"][0][0]
    stop = text[len(text) // 2:][:4]
    expected = stock(endpoint, stream, **request, max_tokens=16, stop=[stop])
    assert expected["choices"][0][-1] == "stop"
    assert ask(servers["generate"].url(), endpoint, stream, **request, max_tokens=16,
               stop=[stop]) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_sampling(servers, stream):
    """A request's own generation_config turns sampling on: tokens are drawn (the random
    stream is not stock's, so only their count is checked)."""
    outcome = ask(servers["generate"].url(), "chat", stream, messages=HELLO, max_tokens=8,
                  temperature=0.8, top_p=0.9, seed=1, extra_body={"generation_config": SAMPLING})
    (content, _, finish), = outcome["choices"]
    assert isinstance(content, str) and finish in ("length", "stop")
    assert 1 <= outcome["usage"][1] <= 8


LONG = [{"role": "user", "content": "river " * 200}]
# Requests hf_paged's engine refuses (max_model_len=128): (endpoint, request, the words its 400
# names, whether the continuous-batching path sees the problem). transformers' manager passes
# a request's prompt, max_new_tokens and EOS only: its sampling values are never seen there.
REFUSED = {
    "chat_too_long": ("chat", dict(messages=LONG, max_tokens=4),
                      "max_model_len (128 tokens", True),
    "completion_too_long": ("completion", dict(prompt="river " * 200, max_tokens=4),
                            "max_model_len (128 tokens", True),
    "chat_max_tokens_too_many": ("chat", dict(messages=HELLO, max_tokens=200),
                                 "max_new_tokens (200)", True),
    # no max_tokens: transformers serve's own default, 1024 new tokens
    "completion_default_max_tokens": ("completion", dict(prompt="Hi"),
                                      "max_new_tokens (1024)", True),
    "chat_zero_max_tokens": ("chat", dict(messages=HELLO, max_tokens=0), "max_new_tokens", True),
    "chat_sampling_negative_temperature": ("chat", dict(
        messages=HELLO, max_tokens=8, temperature=-1,
        extra_body={"generation_config": SAMPLING}), "temperature", False),
    # (a top_p above 1 is no refusal: transformers then adds no top-p warper at all)
    "chat_sampling_zero_top_p": ("chat", dict(
        messages=HELLO, max_tokens=8, top_p=0, extra_body={"generation_config": SAMPLING}),
        "top_p", False),
    # transformers' sequence_bias takes float biases only: a JSON integer is refused
    "chat_logit_bias_integer": ("chat", dict(messages=HELLO, max_tokens=6,
                                             logit_bias={"300": 50}), "sequence_bias", False),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_refused_with_400(servers, stock, mode, stream):
    """What the engine refuses is a 400 in OpenAI's error shape naming the problem (the openai
    client raises BadRequestError with that message), streamed or not, before any response
    starts (stock transformers serve answers a bare 500, or an error event inside a 200 stream,
    when its own generate refuses a value; a prompt beyond max_model_len it serves); requests
    around the refused ones get stock's answers."""
    assert "choices" in stock("chat", messages=LONG, max_tokens=4)
    url = servers[mode].url()
    for name, (endpoint, request, words, seen_by_cb) in REFUSED.items():
        outcome = ask(url, endpoint, stream, **request)
        if mode == "continuous_batching" and not seen_by_cb:
            assert outcome["choices"][0][-1] in ("length", "stop"), (name, outcome)
            continue
        assert outcome["status"] == 400, (name, outcome)
        error = outcome["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], (name,
                                                                                          error)
        valid = CASES["chat"][1]
        assert ask(url, "chat", stream, **valid) == stock("chat", stream, **valid), name
    with client(url) as c, pytest.raises(openai.BadRequestError, match="max_model_len"):
        c.completions.create(model=MODEL, prompt="river " * 200, max_tokens=4, stream=stream)


def test_value_error_backstop():
    """A ValueError that hf_paged raises inside a request handler is a 400 with its message;
    one raised elsewhere keeps Starlette's 500, as in transformers serve."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from hf_paged.integrations import serve_errors
    from hf_paged.sampling_params import SamplingParams

    class State:
        def get_manager(self, model_id: str, use_cb: bool = False):
            return None

    app = FastAPI()
    serve_errors.extend(app, State())

    @app.post("/hf_paged")
    def hf_paged_error():
        SamplingParams(top_p=0.0)

    @app.post("/other")
    def other_error():
        raise ValueError("not hf_paged's")

    with TestClient(app, raise_server_exceptions=False) as http:
        refused = http.post("/hf_paged")
        assert refused.status_code == 400
        assert refused.json() == serve_errors.error_body("top_p must be in (0, 1], got 0.0")
        assert http.post("/other").status_code == 500


@pytest.mark.parametrize("mode", MODES)
def test_models_endpoint(servers, mode):
    with client(servers["stock"].url()) as c:
        expected = [m.id for m in c.models.list()]
    with client(servers[mode].url()) as c:
        assert [m.id for m in c.models.list()] == expected
    assert MODEL in expected


def test_responses_endpoint(servers):
    """``/v1/responses``, which the README lists, answers as stock's does (transformers
    streams its responses, asked to or not)."""
    def answer(url: str) -> list[str]:
        with client(url) as c:
            events = c.responses.create(model=MODEL, input="Hello there", max_output_tokens=8,
                                        stream=True)
            return [e.text for e in events if e.type == "response.output_text.done"]

    expected = answer(servers["stock"].url())
    assert len(expected) == 1 and answer(servers["generate"].url()) == expected


def test_readme_lists_routes_the_installed_server_has(servers):
    """The routes the README names for ``hf-paged serve`` are among those of the installed
    transformers serve's app (its OpenAPI listing)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## transformers' continuous batching", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(/[a-z0-9_/.]+)`", section))
    with urllib.request.urlopen(f"{servers['generate'].url()}/openapi.json", timeout=30) as page:
        served = set(json.load(page)["paths"])
    assert "/v1/chat/completions" in listed and listed <= served, (listed, served)


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_stream_then_server_answers(servers, stock, mode):
    """A client closing a stream early stops its generation; the server goes on answering."""
    url = servers[mode].url()
    with client(url) as c:
        chunks = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100,
                                           stream=True)
        next(chunks), next(chunks)
        chunks.close()
    for endpoint, request in (CASES["chat"], CASES["completion"]):
        assert ask(url, endpoint, **request) == stock(endpoint, **request)


# ---- the command line ----------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["serve", "--engine-option", "bogus=1"], "unknown engine option(s) bogus"),
    (["serve", "--engine-option=block_size=7"], "block_size must be a power of two"),
    (["serve", "--engine-option", "kv_cache_dtype=fp4"], "kv_cache_dtype must be one of"),
    (["serve", "--engine-option", "max_model_len"], "takes KEY=VALUE"),
    (["serve", "--engine-option"], "needs KEY=VALUE"),
    (["run", "--engine-option", "max_num_seqs=0", "-m", "json.tool"], "max_num_seqs"),
    (["run", "no-such-script-or-command"], "no such script or console command"),
    (["run", "-m", "no_such_package.module"], "no module named 'no_such_package.module'"),
])
def test_front_errors_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {argv[0]}: "), err
    assert match in err, err


@pytest.mark.parametrize("missing", [["fastapi"], ["fastapi", "uvicorn"]])
def test_serve_without_its_extras_says_what_to_install(capsys, monkeypatch, missing):
    """As on a machine where transformers was installed without its serving extra: one line,
    before transformers' command is imported, where its own error ends a long traceback."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else find_spec(name, *a))
    assert main(["serve", "some/model", "--port", "1"]) == 2
    err = capsys.readouterr().err
    verb = "is" if len(missing) == 1 else "are"
    assert err == (f"error: serve: transformers serve needs its serving extras, and "
                   f"{', '.join(missing)} {verb} not installed: "
                   'pip install "transformers[serving]"\n')


def test_run_module_with_engine_options(capsys, monkeypatch, tiny_checkpoint):
    """``hf-paged run --engine-option ... -m MODULE ARGS``: the module runs as ``__main__``
    with its arguments, and models it loads through transformers get the engine options."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["run", "--engine-option", "max_model_len=96", "--engine-option",
                     "kv_cache_dtype=fp8", "-m", "tests.clients.print_engine",
                     tiny_checkpoint]) == 0
    finally:
        unpatch_transformers()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Qwen3ForCausalLM max_model_len=96 kv_cache=torch.float8_e4m3fn")
