"""Runs tensor-parallel engines with LoRA adapters as a JSON job list describes (argv[1]) and
writes their tokens as JSON to argv[2]; the LoRA tensor-parallel tests run it as a subprocess
with a timeout, so that a hang fails the test instead of stalling the run.

A job: {"checkpoint": path, "engine": {engine options}, "adapters": {name: folder} (all
loaded first), "mixed": {"lengths", "seed", "names"} (one greedy call, a name per row,
"__base__" for the base model; then the same rows scored by the model call, each on its
adapter), and optionally "late": {"prompts", "first", "second"}: a
request on adapter "first" runs three steps, adapter "second" is removed, an adapter of a
rank above ``max_lora_rank`` is refused, "second" is loaded again (a free slot, while the
first runs), then a request on it is added; both run to the end (by hand: rank 0 only, so not
under torchrun)}. The written result: the mixed call's new tokens and logits, the errors, then each
late request's. Under torchrun every rank writes its own (argv[2] + ".rank<N>").
"""

from __future__ import annotations

import json
import os
import sys

import torch

import hf_paged
from hf_paged.lora.adapter import LoraAdapter, LoraWeight
from hf_paged.lora.reading import read_adapter
from hf_paged.sampling_params import SamplingParams
from tests.conftest import left_padded

NEW = 8


def too_big(engine) -> LoraAdapter:
    """An adapter on layer 0's q_proj of rank one above ``max_lora_rank``."""
    rank, hidden = engine.config.max_lora_rank + 1, engine.hf_config.hidden_size
    return LoraAdapter("too_big", {(0, "q_proj"): LoraWeight(
        torch.zeros(rank, hidden), torch.zeros(hidden, rank), 1.0)})


def run(job: dict) -> dict:
    engine = hf_paged.from_pretrained(job["checkpoint"], **job["engine"])
    with engine:
        def add(name: str) -> None:
            engine.add_lora(name, read_adapter(job["adapters"][name], name, engine.hf_config,
                                               torch.float32))

        for name in job["adapters"]:
            add(name)
        mixed = job["mixed"]
        ids, mask = left_padded(mixed["lengths"], engine.hf_config.vocab_size,
                                seed=mixed["seed"])
        out = engine.generate(ids, attention_mask=mask, adapter_names=mixed["names"],
                              max_new_tokens=NEW, do_sample=False)
        names = [None if n == "__base__" else n for n in mixed["names"]]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        result = dict(mixed=out[:, ids.shape[1]:].tolist(),
                      logits=engine.forward(ids, mask, positions, adapters=names).tolist())
        late = job.get("late")
        if late is None:
            return result
        first = engine.add_request(late["prompts"][0],
                                   SamplingParams(max_new_tokens=NEW, adapter=late["first"]))
        for _ in range(3):
            engine.step()
        engine.remove_lora(late["second"])
        try:
            engine.add_request(late["prompts"][1],
                               SamplingParams(max_new_tokens=NEW, adapter=late["second"]))
            removed_error = None
        except ValueError as e:
            removed_error = str(e)
        try:
            engine.add_lora("too_big", too_big(engine))
            refused_error = None
        except ValueError as e:
            refused_error = str(e)
        add(late["second"])
        second = engine.add_request(late["prompts"][1],
                                    SamplingParams(max_new_tokens=NEW, adapter=late["second"]))
        engine.run([first, second])
        return dict(result, removed_error=removed_error, refused_error=refused_error,
                    late=[first.output_token_ids, second.output_token_ids],
                    num_loras=engine.stats()["num_loras"])


def main() -> None:
    jobs, out = json.loads(sys.argv[1]), sys.argv[2]
    results = [run(job) for job in jobs]
    if "RANK" in os.environ:
        out += f".rank{os.environ['RANK']}"
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
