"""A plain transformers generation script, timed: W1's first requests as left-padded batches
through ``model.generate`` (greedy, EOS ignored). Nothing in it knows hf_paged: run it as is
for stock transformers, or as ``python -m hf_paged run benchmarks/dropin_script.py ...`` to
serve the same calls from the engine. Prints one JSON line of figures.

usage: python benchmarks/dropin_script.py CHECKPOINT [--num-requests 64] [--batch-size 64]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.workloads import MAX_TOKEN_ID, w1  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--num-requests", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map=device)
model.eval()
load_seconds = time.perf_counter() - start
max_token_id = min(MAX_TOKEN_ID, model.config.vocab_size - 1)
requests = w1(max_token_id=max_token_id).head(args.num_requests)
pad = model.generation_config.pad_token_id or 0


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(model.device), mask.to(model.device)


def generate(prompts, new_tokens):
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=pad)
    assert out.shape[1] - ids.shape[1] == new_tokens, "a row stopped early"


with torch.no_grad():
    generate([p[:16] for p in requests.prompts[:2]], 8)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    computed = 0
    for first in range(0, len(requests.prompts), args.batch_size):
        prompts = requests.prompts[first:first + args.batch_size]
        new_tokens = max(requests.max_new_tokens[first:first + args.batch_size])
        generate(prompts, new_tokens)
        computed += new_tokens * len(prompts)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

useful = sum(requests.max_new_tokens)
print(json.dumps({
    "model_class": f"{type(model).__module__}.{type(model).__name__}",
    "load_seconds": round(load_seconds, 2),
    "generate_seconds": round(seconds, 3),
    "num_requests": len(requests.prompts),
    "batch_size": args.batch_size,
    "useful_output_tokens": useful,
    "computed_output_tokens": computed,
    "output_tokens_per_s": round(useful / seconds, 1),
}))
