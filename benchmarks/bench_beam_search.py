"""Beam search: hf_paged against stock transformers beam search, in the same run.

    python -m benchmarks.bench_beam_search --model /tmp/ckpt/0.6b

64 prompts of 512 random token ids (``random.seed(0)``), 4 beams, 128 new tokens, no EOS (so
every hypothesis runs its full length and both systems do the same work), length penalty and
early stopping at their defaults. Both systems take the whole batch in one ``generate`` call
after a warm-up call on other prompts. Reported: wall time and returned tokens per second,
hf_paged's speedup, and the peak KV-cache memory of each: for hf_paged the most blocks in use
at any step (beams share their prompt and common history), for transformers the bytes of its
cache at the end (its largest: ``num_beams`` full copies of every row), and the peak device
memory each call allocated beyond what it held before. Sequences of the two are compared row
by row (in bf16 they part at near-ties, so agreement is reported, not required).
"""

from __future__ import annotations

import argparse
import random

import torch

import hf_paged
from benchmarks import common
from benchmarks.summary import summary_row
from benchmarks.systems import load_transformers_model

BASELINES = ("generate",)


def prompts_tensor(num_prompts: int, prompt_len: int, max_id: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    # Ids from 3 up: small ids are special tokens (a pad id inside a prompt reads as padding).
    return torch.tensor([[rng.randint(3, max_id) for _ in range(prompt_len)]
                         for _ in range(num_prompts)])


def beam_kwargs(args: argparse.Namespace) -> dict:
    return dict(num_beams=args.num_beams, max_new_tokens=args.new_tokens, do_sample=False,
                eos_token_id=None)


def peak_allocated(fn, device: torch.device):
    """``fn()``, its wall time, and the device memory it allocated beyond what was held (None
    off CUDA)."""
    common.free_memory()
    if device.type != "cuda":
        return *common.timed(fn, device), None
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    out, seconds = common.timed(fn, device)
    return out, seconds, torch.cuda.max_memory_allocated(device) - held


def run_hf_paged(args, ids, warmup, device, dtype) -> tuple[dict, torch.Tensor]:
    engine, startup_s = common.timed(
        lambda: hf_paged.from_pretrained(args.model, dtype=dtype, device=device,
                                         **common.engine_options(args.engine_option)), device)
    kwargs = beam_kwargs(args)
    engine.generate(warmup, **kwargs)
    bm = engine.block_manager
    peak = {"blocks": 0, "saved": 0}
    step = engine.step

    def counted_step():
        finished = step()
        in_use = bm.num_blocks - bm.num_free_blocks
        if in_use > peak["blocks"]:
            peak.update(blocks=in_use, saved=bm.num_blocks_saved)
        return finished

    engine.step = counted_step
    out, seconds = common.timed(lambda: engine.generate(ids.to(device), **kwargs), device)
    block_bytes = engine.executor.runner.kv.block_bytes()
    figures = {
        "wall_s": seconds,
        "returned_tokens_per_s": ids.shape[0] * args.new_tokens / seconds,
        "peak_kv_bytes": peak["blocks"] * block_bytes,
        "peak_kv_blocks": peak["blocks"],
        # What the same beams would hold without sharing: the blocks sharing saved at the peak.
        "peak_kv_bytes_unshared": (peak["blocks"] + peak["saved"]) * block_bytes,
        "startup_s": startup_s,
        "stats": engine.stats(),
    }
    out = out.cpu()
    engine.close()  # its KV cache and weights make room for transformers
    return figures, out


def run_transformers(args, ids, warmup, device, dtype) -> tuple[dict, torch.Tensor]:
    model = load_transformers_model(args.model, dtype, device)
    kwargs = beam_kwargs(args)
    model.generate(warmup.to(device), **kwargs)

    def call():
        return model.generate(ids.to(device), return_dict_in_generate=True, **kwargs)

    out, seconds, peak = peak_allocated(call, device)
    cache = out.past_key_values
    kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (layer.keys, layer.values))
    figures = {
        "wall_s": seconds,
        "returned_tokens_per_s": ids.shape[0] * args.new_tokens / seconds,
        "peak_kv_bytes": kv_bytes,
        "peak_allocated_bytes": peak,
    }
    return figures, out.sequences.cpu()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, BASELINES)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-beams", type=int, default=4)
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    max_id = common.max_token_id(args.model)
    ids = prompts_tensor(args.num_prompts, args.prompt_len, max_id, seed=0)
    warmup = prompts_tensor(4, args.prompt_len, max_id, seed=1)
    result = common.ResultFile("beam", args, device, summary)
    result["workload_description"] = (
        f"{args.num_prompts} prompts x {args.prompt_len} random token ids (random.seed(0)), "
        f"num_beams={args.num_beams}, {args.new_tokens} new tokens, no EOS, one generate call"
    )
    result["baseline_requests"] = args.num_prompts if args.baselines else None
    common.reuse_baselines(result, args)
    print("beam hf_paged")
    result["hf_paged"]["hf_paged"], ours = run_hf_paged(args, ids, warmup, device, dtype)
    result.save()
    theirs = {}

    def transformers_run() -> dict:
        figures, theirs["sequences"] = run_transformers(args, ids, warmup, device, dtype)
        return figures

    common.run_baselines(result, args, {"generate": transformers_run})
    if "sequences" in theirs:
        same = (ours == theirs["sequences"]).all(dim=1).float().mean().item()
        result["hf_paged"]["hf_paged"]["rows_equal_to_transformers"] = same
    common.finish(result)


def summary(data: dict) -> list[dict]:
    figures = data["hf_paged"]["hf_paged"]
    return [
        summary_row("returned tok/s", figures["returned_tokens_per_s"],
                           data["baselines"], "returned_tokens_per_s", floor=None,
                           higher_is_better=True),
        summary_row("peak KV GiB", figures["peak_kv_bytes"] / 2**30,
                           {name: {"peak_kv_gib": fig["peak_kv_bytes"] / 2**30}
                            if "peak_kv_bytes" in fig else fig
                            for name, fig in data["baselines"].items()},
                           "peak_kv_gib", floor=None, higher_is_better=False),
    ]


if __name__ == "__main__":
    main()
