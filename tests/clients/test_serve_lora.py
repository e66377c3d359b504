"""``hf-paged serve MODEL --lora a=PATH --lora b=PATH``: two PEFT adapters of the tiny
checkpoint (float32 on CPU) served by name beside the base model, driven by the official openai
client over loopback: through transformers' ``model.generate`` path, its continuous batching,
and continuous batching with ``--engine-process``.

Each adapter's answer (greedy) is stock transformers + PEFT's with that adapter, the base
model's name answers as the base model, requests for all three run at once; an unknown name
is a 400 naming it and the server goes on; ``/v1/models`` lists the adapters and ``/metrics``
counts them; a bad ``--lora`` is one error line naming it.
"""

from __future__ import annotations

import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from hf_paged.cli import main
from hf_paged.integrations.patch import unpatch_transformers
from tests.clients.serve_helpers import MODEL, ServerProcess, ask, client, hub_cache, server_env
from tests.conftest import SMALL
from tests.lora_adapters import ADAPTERS, save_adapter, stock_peft

MODES = {"generate": [], "continuous_batching": ["--continuous-batching"],
         "engine_process": ["--continuous-batching", "--engine-process"]}
MAX_TOKENS = 12
PROMPT = "Once upon a time"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    """Two of the LoRA tests' adapters, served as a (q and v) and b (all seven projections)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_adapter(tiny_checkpoint, str(root / name), seed, **ADAPTERS[form])
            for seed, (name, form) in enumerate({"a": "qv", "b": "all"}.items())}


def greedy(checkpoint: str, adapter: str | None, prompt: list[int]) -> list[int]:
    """Stock transformers' greedy new tokens, with PEFT's ``adapter`` (a folder; None: the
    base model)."""
    model = (stock_peft(checkpoint, {"adapter": adapter}) if adapter else
             transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_checkpoint, adapters):
    """mode -> ServerProcess serving ``MODEL`` with adapters a and b."""
    root = tmp_path_factory.mktemp("serve_lora")
    env = server_env(hub_cache(root / "hub", tiny_checkpoint))
    argv = [sys.executable, "-m", "hf_paged", "serve", MODEL,
            "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
            *(f"--engine-option={k}={v}" for k, v in SMALL.items()),
            *(f"--lora={name}={path}" for name, path in adapters.items())]
    started = {mode: ServerProcess([*argv, *flags], env, root / f"{mode}.log")
               for mode, flags in MODES.items()}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, adapters):
    """(model name, endpoint) -> stock transformers + PEFT's outcome of ``request`` below (the
    base model's for ``MODEL``), as ``comparable`` reports a response."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompts = {"completion": tokenizer(PROMPT)["input_ids"],
               "chat": tokenizer.apply_chat_template(HELLO, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]}
    outcomes = {}
    for name in (MODEL, *adapters):
        for endpoint, prompt in prompts.items():
            new = greedy(tiny_checkpoint, adapters.get(name), prompt)
            text = tokenizer.decode(new, skip_special_tokens=True)
            finish = "length" if len(new) == MAX_TOKENS else "stop"
            outcomes[name, endpoint] = {"choices": [(text, None, finish)],
                                        "usage": (len(prompt), len(new))}
    assert len({str(outcomes[n, "completion"]) for n in (MODEL, *adapters)}) == 3  # all differ
    return outcomes


def comparable(outcome: dict, endpoint: str, stream: bool = False) -> dict:
    """``serve_helpers.ask``'s outcome (or the expected one), a chat message's text stripped
    (transformers' response parser trims a whole message's, not a stream's), and a stream's
    without a trailing replacement character (transformers' streamer holds back the bytes of
    a character cut short by the last token, which a whole decode shows as one)."""
    def text(value: str) -> str:
        value = value.strip() if endpoint == "chat" else value
        return value.rstrip("\ufffd") if stream else value

    return dict(outcome, choices=[(text(t), *rest) for t, *rest in outcome["choices"]])


def request(endpoint: str) -> dict:
    prompt = dict(messages=HELLO) if endpoint == "chat" else dict(prompt=PROMPT)
    return dict(prompt, max_tokens=MAX_TOKENS, temperature=0)


@pytest.mark.parametrize("mode", MODES)
def test_each_name_answers_as_peft_at_once(servers, expected, mode):
    """Base, a and b, each by completions and chat, streamed and whole: all twelve requests
    sent at once (with continuous batching, the engine batches them together), each answered
    as PEFT answers."""
    url = servers[mode].url()
    cases = [(name, endpoint, stream) for name in (MODEL, "a", "b")
             for endpoint in ("completion", "chat") for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        outcomes = list(pool.map(lambda case: ask(url, case[1], case[2], model=case[0],
                                                  **request(case[1])), cases))
    for (name, endpoint, stream), outcome in zip(cases, outcomes):
        assert comparable(outcome, endpoint, stream) == comparable(
            expected[name, endpoint], endpoint, stream), (name, endpoint, stream)


@pytest.mark.parametrize("mode", MODES)
def test_responses_name_the_adapter(servers, expected, mode):
    """A completion names the adapter as its model; so does ``/v1/responses``, whose text is
    the chat's."""
    with client(servers[mode].url()) as c:
        response = c.completions.create(model="a", prompt=PROMPT, max_tokens=2)
        assert response.model == "a"
        events = list(c.responses.create(model="a", input=HELLO[0]["content"], stream=True,
                                          max_output_tokens=MAX_TOKENS, temperature=0))
    (done,) = [e for e in events if e.type == "response.completed"]
    assert done.response.model == "a"
    assert done.response.output_text.strip() == expected["a", "chat"]["choices"][0][0].strip()


@pytest.mark.parametrize("mode", MODES)
def test_unknown_name_is_a_400_naming_it(servers, expected, mode):
    url = servers[mode].url()
    for endpoint in ("completion", "chat"):
        outcome = ask(url, endpoint, model="c", **request(endpoint))
        assert outcome["status"] == 400, outcome
        message = outcome["error"]["message"]
        assert "'c'" in message and "'a', 'b'" in message and MODEL in message, message
    assert ask(url, "completion", model="b", **request("completion")) == expected[
        "b", "completion"]  # and the server goes on


@pytest.mark.parametrize("mode", MODES)
def test_models_and_metrics_list_the_adapters(servers, adapters, mode):
    url = servers[mode].url()
    with client(url) as c:
        models = {m.id: m for m in c.models.list()}
    assert list(models) == [MODEL, "a", "b"]
    for name, path in adapters.items():
        assert (models[name].model_extra["parent"], models[name].model_extra["root"]) == (
            MODEL, path)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as page:
        metrics = page.read().decode()
    assert f'hf_paged_lora_adapters{{model="{MODEL}@main"}} 2.0' in metrics, metrics


# ---- the command line ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def dora(tmp_path_factory, tiny_checkpoint) -> str:
    return save_adapter(tiny_checkpoint, str(tmp_path_factory.mktemp("dora") / "d"), 3,
                        **ADAPTERS["qv"], use_dora=True)


@pytest.mark.parametrize("spec, match", [
    ("a", "--lora takes NAME=PATH"),
    ("=x", "--lora takes NAME=PATH"),
    ("a=/no/such/folder", "--lora a=/no/such/folder: no such folder"),
])
def test_bad_spec_is_one_line(capsys, spec, match):
    assert main(["serve", "some/model", "--lora", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: serve: "), err
    assert match in err, err


@pytest.mark.parametrize("case", ["dora", "no_model", "rank", "rank_engine_process"])
def test_refused_before_serving_in_one_line(capsys, monkeypatch, tiny_checkpoint, adapters, dora,
                                            case):
    """A DoRA adapter is refused by name before the base model loads; ``--lora`` without the
    model named on the command line before anything loads; an adapter the engine cannot hold
    (its rank over ``max_lora_rank``) as the engine takes it, in this process or the engine's
    own."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    spec = f"d={dora}" if case in ("dora", "no_model") else f"a={adapters['a']}"
    argv = ["serve", "--device", "cpu", "--port", "1",
            "--engine-option", "max_lora_rank=2", f"--lora={spec}"]
    argv += [] if case == "no_model" else [tiny_checkpoint]
    argv += ["--continuous-batching", "--engine-process"] if case == "rank_engine_process" else []
    try:
        status = main(argv)
    finally:
        unpatch_transformers()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and err.startswith("error: serve: --lora "), err
    if case == "dora":
        assert f"--lora {spec}: " in err and "use_dora=True" in err, err
    elif case == "no_model":
        assert "needs the model named on the command line" in err, err
    else:
        assert err.endswith(f"--lora {spec}: adapter 'a' has rank 8, above max_lora_rank=2"), err
