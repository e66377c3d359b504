"""The systems under test, behind one interface: ``run(workload)`` generates every request's
``max_new_tokens`` (EOS ignored) and returns the useful output tokens; ``describe()`` returns
facts for the result JSON; ``close()`` frees the device memory. ``first_streamed_token_s``
(where a system has it) times a ``generate`` call with a streamer, from the call to the
streamer's first generated token: time to first token as a streaming user sees it.

- ``PagedSystem``: hf_paged's engine (``generate_tokens`` with ``ignore_eos=True``).
- ``GenerateSystem``: stock ``model.generate`` over left-padded batches (``static=True`` adds
  ``cache_implementation="static"``, which transformers compiles on CUDA). A batch generates the
  largest ``max_new_tokens`` of its requests; only each request's own count is useful.
- ``ContinuousBatchingSystem``: transformers' continuous batching manager, one ``add_request``
  per request with its own ``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_paged
from benchmarks.common import free_memory
from benchmarks.workloads import Workload

NO_EOS = -1  # transformers' continuous batching reads a negative EOS id as "no EOS"


class System(Protocol):
    def run(self, workload: Workload) -> int: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class FirstTokenTimer(BaseStreamer):
    """Seconds from its creation to the first generated token (``generate`` puts the prompt
    first, then each new token)."""

    def __init__(self):
        self.start, self.puts, self.seconds = time.perf_counter(), 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def check_lengths(generated: list[int], workload: Workload) -> int:
    """The useful output tokens; raises if any request generated other than it asked."""
    wrong = [(g, n) for g, n in zip(generated, workload.max_new_tokens) if g != n]
    if wrong:
        raise RuntimeError(
            f"{len(wrong)} request(s) generated a wrong count, e.g. (got, asked) {wrong[0]}"
        )
    return sum(workload.max_new_tokens)


class PagedSystem:
    COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                "num_draft_tokens", "num_accepted_tokens", "num_verify_steps")

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device,
                 sampling: dict[str, Any] | None = None, **options: Any):
        """``sampling``: more SamplingParams fields for every request."""
        self.engine = hf_paged.from_pretrained(path, dtype=dtype, device=device, **options)
        self.sampling = sampling or {}
        self.last_run: dict[str, int] = {}

    def run(self, workload: Workload) -> int:
        params = [
            hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True, **self.sampling)
            for n in workload.max_new_tokens
        ]
        before = self.engine.stats()
        outputs = self.engine.generate_tokens(workload.prompts, params, progress_bar=False)
        after = self.engine.stats()
        self.last_run = {name: after[name] - before[name] for name in self.COUNTERS}
        return check_lengths([len(o) for o in outputs], workload)

    def first_streamed_token_s(self, prompt: list[int]) -> float:
        hits = self.engine.stats()["prefix_cache_hits"]
        timer = FirstTokenTimer()
        self.engine.generate(torch.tensor([prompt]), max_new_tokens=2, streamer=timer)
        if self.engine.stats()["prefix_cache_hits"] != hits:
            raise RuntimeError("the prefix cache served a first-token prompt: not a prefill time")
        return timer.seconds

    def describe(self) -> dict[str, Any]:
        facts = {
            "engine_config": dataclasses.asdict(self.engine.config),
            "sampling": self.sampling,
            "startup_seconds": self.engine.startup_seconds,
            "last_run_counters": self.last_run,
            "stats": self.engine.stats(),
        }
        if self.engine.config.data_parallel_size == 1:  # else the replicas' processes hold it
            runner = self.engine.executor.runner  # start-up's choices, measured on this device
            facts["projection_timings"] = runner.projection_timings
            facts["all_reduce_choices"] = getattr(runner.tp.fast_all_reduce, "choices", None)
        return facts

    def close(self) -> None:
        self.engine.close()  # tensor-parallel workers stop before the next system starts
        del self.engine
        free_memory()


def load_transformers_model(path: str, dtype: torch.dtype, device: torch.device, **load: Any):
    """``load``: more ``from_pretrained`` arguments (``device_map``, ``quantization_config``)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load).to(device).eval()


def pad_token_id(model) -> int:
    pad = model.generation_config.pad_token_id
    pad = model.config.pad_token_id if pad is None else pad
    return 0 if pad is None else pad


def sampling_kwargs(temperature: float) -> dict[str, Any]:
    """transformers' settings for hf_paged's ``SamplingParams(temperature=...)``: greedy at 0,
    else plain temperature sampling (transformers' default top_k=50 turned off)."""
    if not temperature:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0}


class GenerateSystem:
    """``max_cache_len`` (static cache only) fixes the cache size of every call, so that the
    warm-up compiles the shapes the measured calls use; ``load``: more ``from_pretrained``
    arguments."""

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        batch_size: int,
        static: bool = False,
        max_cache_len: int | None = None,
        temperature: float = 0.0,
        load: dict[str, Any] | None = None,
    ):
        self.model = load_transformers_model(path, dtype, device, **(load or {}))
        self.device, self.batch_size, self.static = device, batch_size, static
        self.pad = pad_token_id(self.model)
        # Keyword arguments override the checkpoint's generation config, EOS included.
        self.kwargs: dict[str, Any] = dict(
            **sampling_kwargs(temperature), eos_token_id=None, pad_token_id=self.pad
        )
        if static:
            self.kwargs.update(cache_implementation="static", max_cache_len=max_cache_len)
        self.computed_tokens = 0

    def first_streamed_token_s(self, prompt: list[int]) -> float:
        timer = FirstTokenTimer()
        ids = torch.tensor([prompt], device=self.device)
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                            streamer=timer, **self.kwargs)
        return timer.seconds

    def run(self, workload: Workload) -> int:
        self.computed_tokens = 0
        for start in range(0, len(workload.prompts), self.batch_size):
            prompts = workload.prompts[start : start + self.batch_size]
            new = max(workload.max_new_tokens[start : start + self.batch_size])
            input_ids, mask = self._left_pad(prompts)
            out = self.model.generate(
                input_ids, attention_mask=mask, max_new_tokens=new, **self.kwargs
            )
            if out.shape[1] - input_ids.shape[1] != new:  # with no EOS no row may stop early
                raise RuntimeError(
                    f"generate made {out.shape[1] - input_ids.shape[1]} of {new} tokens"
                )
            self.computed_tokens += new * len(prompts)
        return sum(workload.max_new_tokens)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def describe(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "computed_tokens": self.computed_tokens,  # of the last run, padding rows included
            "attn_implementation": self.model.config._attn_implementation,
            **({"compiled": self.device.type == "cuda"} if self.static else {}),
        }

    def close(self) -> None:
        del self.model
        free_memory()


class ContinuousBatchingSystem:
    """A manager sized by ``workload_hints`` for the largest request, warmed up (CUDA graphs on
    CUDA) and started at construction; ``run`` adds the requests and waits for all of them."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, sizing: Workload,
                 temperature: float = 0.0):
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.model = load_transformers_model(path, dtype, device)
        config = GenerationConfig(
            **sampling_kwargs(temperature),
            eos_token_id=NO_EOS,
            pad_token_id=pad_token_id(self.model),
            max_new_tokens=max(sizing.max_new_tokens),
        )
        hints = WorkloadHints(
            max_prompt_length=max(map(len, sizing.prompts)),
            max_generated_length=max(sizing.max_new_tokens),
            num_requests=len(sizing.prompts),
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=config, workload_hints=hints
        )
        self.manager.warmup()
        self.manager.start()

    def run(self, workload: Workload) -> int:
        ids = [
            self.manager.add_request(prompt, max_new_tokens=n, eos_token_id=NO_EOS)
            for prompt, n in zip(workload.prompts, workload.max_new_tokens)
        ]
        if None in ids:
            raise RuntimeError("the continuous batching manager refused a request")
        finished: dict[str, int] = {}
        while len(finished) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped before the end")
            elif result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                finished[result.request_id] = len(result.generated_tokens)
        return check_lengths([finished[i] for i in ids], workload)

    def describe(self) -> dict[str, Any]:
        cb = vars(self.manager.continuous_batching_config)
        return {
            "attn_implementation": self.model.config._attn_implementation,
            "continuous_batching_config": {k: repr(v) for k, v in cb.items() if k[0] != "_"},
        }

    def close(self) -> None:
        self.manager.stop(block=True)
        self.manager.destroy()
        del self.manager, self.model
        free_memory()
