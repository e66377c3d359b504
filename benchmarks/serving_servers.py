"""The servers the serving benchmark starts and reads: their command lines (hf-paged serve in one
process or with ``--engine-process``, stock transformers serve), a checkpoint whose tokens all
decode, a free port, readiness, and hf-paged serve's ``/metrics``."""

from __future__ import annotations

import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path


def server_command(system: str, model: str, port: int, engine_options: list[str],
                   serve_args: list[str] = ()) -> list[str]:
    common = [model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
              "--dtype", "bfloat16", "--log-level", "warning"]
    if system == "transformers":
        return [sys.executable, "-c", "from transformers.cli.transformers import main; main()",
                "serve", *common]
    options = [a for o in engine_options for a in ("--engine-option", o)]
    split = ["--engine-process"] if system == "hf_paged_engine_process" else []
    return [sys.executable, "-m", "hf_paged", "serve", *common, *options, *split, *serve_args]


def decodable_copy(model: str, out: Path, tokenizer_size: int) -> str:
    """The checkpoint with the LM head's rows past the tokenizer's ids zeroed (the embedding's
    too, when they are tied): the model then generates only tokens the tokenizer decodes, so
    every token reaches the client as text, at the same shapes and cost. Random checkpoints
    come with a 1,024-id tokenizer for a 151,936-id model; most of what they generate would
    otherwise stream nothing."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        return str(out)
    shutil.copytree(model, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name in tensors:
                tensors[name][tokenizer_size:] = 0
        save_file(tensors, str(file), metadata={"format": "pt"})
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, model: str, deadline: float) -> None:
    """Until the server answers a two-token completion (the model loaded, warmed up)."""
    from openai import OpenAI

    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        while True:
            try:
                client.completions.create(model=model, prompt="Hello", max_tokens=2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)


def scrape(url: str) -> dict[str, float]:
    """hf-paged serve's /metrics, the samples without labels but ``le`` (empty for a server
    without /metrics)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except Exception:
        return {}
    return {s.name + (f"_le_{s.labels['le']}" if "le" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}
