"""Speculative decoding (W6): batch-1 tokens/s of the 8B shape against measured acceptance, and
W1 with engine-wide prompt lookup.

    python -m benchmarks.bench_speculation --model /tmp/ckpt/0.6b --checkpoints /tmp/ckpt/spec

Random weights make acceptance meaningless, so the target (``--target-shape``, 8B) and its
drafts (``--draft-shape``, 0.6B: the same vocabulary) are built to follow a token permutation
(``benchmarks.known_acceptance``), each draft differing from the target on a fraction ``f`` of
the tokens (``--changed``), so its drafts are accepted at about ``1 - f`` a token. They are
built once under ``--checkpoints`` (the weights drawn on ``--device``) and reused.

Batch-1 lines, greedy, ``--prompt-len``-token prompts and ``--new-tokens`` new tokens, each the
median of ``--repeats`` requests after a warm-up request on another prompt: hf_paged plain
decode; with each draft as ``assistant_model`` and with the target as its own draft (a second
copy of it), ``--num-draft-tokens`` drafts a step; prompt lookup on prompts that walk a short
cycle of the permutation twice (the continuation repeats the prompt) and on random prompts
(nothing repeats: speculation should cost little). transformers' baselines run on the same
checkpoints with fewer new tokens (``--stock-new-tokens``, stock decoding takes tens of ms a
token): plain greedy, assisted generation with the ``--stock-changed`` draft, prompt lookup.
Every output is checked token for token against plain greedy output and the permutation.

W1 (nano-vllm's workload at temperature 0.6, on ``--model``, the standard W1 checkpoint) runs
with and without the engine-wide ``speculative_method="ngram"``, first, on an empty GPU (its
engines size their KV cache from free memory); the batch-1 engines take a small fixed cache
(``BATCH1_OPTIONS``), so a draft and a second target fit beside the target.

The floor of a plain decode token reads the weights and the request's KV cache once
(``benchmarks.floor``); speculation keeps several tokens a step, so it may pass that floor.
Acceptance comes from ``engine.stats()``: drafts accepted over drafts proposed, and the
per-token acceptance ``a`` whose ``E[tokens/step] = (1 - a^(k+1)) / (1 - a)`` matches the
accepted drafts per verify step.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

import hf_paged
from benchmarks import common
from benchmarks import known_acceptance as known
from benchmarks.bench_throughput import measure as measure_throughput
from benchmarks.floor import MemoryCost, floor_settings
from benchmarks.speculation_lines import Context, Line, as_assistant, measure_paged, measure_stock
from benchmarks.summary import summary_row
from benchmarks.systems import PagedSystem, load_transformers_model
from benchmarks.workloads import Workload, w1

BASELINES = ("generate", "assisted", "prompt_lookup")  # in this order: plain's time first
# Batch-1 engines: a small fixed KV cache (the target, a draft and a second target fit beside
# each other) and no prefix cache (the lines share prompts: each prefills them in full, as
# plain did).
BATCH1_OPTIONS = {"num_kv_blocks": 128, "enable_prefix_caching": False}  # 8,192 tokens


def paged_lines(result: common.ResultFile, args: argparse.Namespace, target: dict,
                drafts: dict[float, dict], ctx: Context, dtype: torch.dtype) -> None:
    """hf_paged's batch-1 lines on one target engine, each draft loaded for its line."""
    options = {**BATCH1_OPTIONS, **common.engine_options(args.engine_option)}
    load = partial(hf_paged.AutoModelForCausalLM.from_pretrained, dtype=dtype, device=ctx.device,
                   **options)
    k = args.num_draft_tokens
    model, startup = common.timed(lambda: load(target["path"]), ctx.device)

    def record(line: Line, draft_path: str | None = None) -> None:
        def run() -> dict:
            if draft_path is None:
                return measure_paged(model, line, ctx)
            draft, seconds = common.timed(lambda: as_assistant(load(draft_path), k), ctx.device)
            try:
                line.speculation["assistant_model"] = draft
                line.facts.update(draft_checkpoint=draft_path, draft_startup_s=seconds)
                return measure_paged(model, line, ctx)
            finally:
                draft.engine.close()

        print(f"speculation {line.label}")
        result["hf_paged"][line.label] = common.guarded(line.label, run)
        result.save()

    try:
        for kind in ("random", "repeating"):
            record(Line(f"plain_{kind}", kind, facts={
                "description": "plain" + ("" if kind == "random" else ", repeating prompts"),
                "startup_s": startup}))
        for f, draft in drafts.items():
            record(Line(f"draft_{args.draft_shape}_f{f:g}", "random", facts={
                "description": f"{args.draft_shape} draft, {1 - f:.0%} agreement",
                "changed_fraction": f, "design_acceptance": 1 - f},
                draft_successor=draft["successor"]), draft["path"])
        if not args.skip_self_draft:
            record(Line("self_draft", "random", facts={
                "description": "target as its own draft", "design_acceptance": 1.0},
                draft_successor=target["successor"]), target["path"])
        for kind in ("repeating", "random"):
            record(Line(f"prompt_lookup_{kind}", kind, {"prompt_lookup_num_tokens": k},
                        {"description": f"prompt lookup, {kind} prompts"}))
    finally:
        model.engine.close()  # its memory goes with this frame (main then frees the cache)


def stock_lines(result: common.ResultFile, args: argparse.Namespace, target: dict,
                drafts: dict[float, dict], ctx: Context, dtype: torch.dtype) -> None:
    """transformers' own lines named by ``--baselines`` (assisted generation takes batch 1
    only), unless reused."""
    if args.reuse_baselines is not None:
        return
    k = args.num_draft_tokens
    lines = {
        "generate": Line("transformers_generate", "random", facts={"description": "plain"}),
        "assisted": Line("transformers_assisted", "random", facts={
            "description": f"{args.draft_shape} draft, {1 - args.stock_changed:.0%} agreement",
            "changed_fraction": args.stock_changed}),
        "prompt_lookup": Line("transformers_prompt_lookup", "repeating",
                              {"prompt_lookup_num_tokens": k},
                              {"description": "prompt lookup, repeating prompts"}),
    }
    model = load_transformers_model(target["path"], dtype, ctx.device) if args.baselines else None
    for key in sorted(args.baselines, key=BASELINES.index):
        line = lines[key]

        def run(line: Line = line) -> dict:
            if line.label == "transformers_assisted":
                path = drafts[args.stock_changed]["path"]
                draft = load_transformers_model(path, dtype, ctx.device)
                line.speculation["assistant_model"] = as_assistant(draft, k)
            return measure_stock(model, line, ctx, args.stock_repeats)

        print(f"speculation {line.label}")
        result["baselines"][line.label] = common.guarded(line.label, run)
        line.speculation.pop("assistant_model", None)  # the draft's memory goes now
        result.save()


def w1_lines(result: common.ResultFile, args: argparse.Namespace, device: torch.device,
             dtype: torch.dtype) -> None:
    """W1 on the standard checkpoint without and with engine-wide prompt lookup."""
    sizes = {"num_requests": args.w1_num_requests, "max_input_len": args.w1_max_input_len,
             "max_output_len": args.w1_max_output_len}
    sizes = {name: value for name, value in sizes.items() if value is not None}
    workload = w1(**sizes, max_token_id=common.max_token_id(args.model))
    cost = MemoryCost.from_checkpoint(args.model, dtype)
    result["w1_floor"] = floor_settings(device, args.bandwidth, cost)
    result["workload_description"]["w1"] = {
        "description": w1.__doc__.splitlines()[0], **sizes, **workload.describe(),
        "temperature": args.w1_temperature, "checkpoint": args.model}
    options = common.engine_options(args.engine_option)
    ngram = {"speculative_method": "ngram", "num_speculative_tokens": args.num_draft_tokens}
    lines = [("w1", {}), ("w1_ngram", ngram)]
    # Two rounds, the second in the other order, each line's best run kept: the two lines
    # differ by less than run-to-run noise (a fresh engine each run).
    for round_ in range(2):
        for label, extra in lines if round_ == 0 else lines[::-1]:
            print(f"speculation {label} (run {round_ + 1})")
            build = partial(PagedSystem, args.model, dtype, device,
                            sampling={"temperature": args.w1_temperature}, **{**options, **extra})
            figures = common.guarded(label, partial(
                measure_throughput, build, workload, 64, cost,
                result["w1_floor"]["bandwidth_bytes_per_s"], device))
            best = result["hf_paged"].get(label)
            runs = [*(best or {}).get("runs_output_tokens_per_s", []),
                    figures.get("output_tokens_per_s")]
            if best is None or figures.get("output_tokens_per_s", 0) > best.get(
                    "output_tokens_per_s", 0):
                best = figures
            result["hf_paged"][label] = dict(best, runs_output_tokens_per_s=runs)
            result.save()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    spec = known.CycleSpec(cycle_len=args.cycle_len, long_cycle_len=args.long_cycle_len)
    target, drafts = known.build_pair(args.checkpoints, args.target_shape, args.draft_shape,
                                      args.changed, spec, args.dtype, args.device)
    common.free_memory()  # the build's weights, before any engine sizes its cache
    result = common.ResultFile("speculation", args, device, summary)
    result["checkpoint"] = {"target": target["path"], "dtype": args.dtype, "w1": args.model,
                            "drafts": {f"{f:g}": d["path"] for f, d in drafts.items()}}
    n = args.repeats + 1  # the first prompt of each kind warms up
    prompts = {"random": known.random_prompts(target, n, args.prompt_len, seed=0),
               "repeating": known.repeating_prompts(target, n, args.prompt_len, seed=0)}
    k = args.num_draft_tokens
    result["workload_description"] = {
        "description": "W6 speculation: batch 1, greedy, on checkpoints of known acceptance",
        "target_shape": args.target_shape, "draft_shape": args.draft_shape,
        "construction": known.__doc__.split("\n\n")[1].replace("\n", " "),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "stock_new_tokens": args.stock_new_tokens, "stock_repeats": args.stock_repeats,
        "stock_note": "transformers' lines run the first stock_repeats measured prompts for "
                      "stock_new_tokens new tokens each (their per-token figures spread the "
                      "prefill over fewer tokens); a transformers line's speedup_vs_plain is "
                      "over transformers' plain greedy",
        "num_draft_tokens": k, "changed_fractions": args.changed,
        "stock_changed_fraction": args.stock_changed, "cycles": asdict(spec),
        "prompts": {"random": "random tokens of the long cycles: nothing repeats",
                    "repeating": f"a walk of {args.prompt_len} tokens along a short cycle of "
                                 f"{args.cycle_len}: the continuation repeats it"},
        "prompt_lookup": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 2},
        "batch1_engine_options": {**BATCH1_OPTIONS, **common.engine_options(args.engine_option)},
    }
    result["assistant_settings"] = {
        "num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
        "why": "threshold 0 turns it off (None would mean transformers' default 0.4): every "
               "step drafts num_assistant_tokens, so acceptance is the draft's alone"}
    cost = MemoryCost.from_checkpoint(target["path"], dtype)
    floor = floor_settings(device, args.bandwidth, cost)
    one = cost.floor_bytes(Workload([prompts["random"][1]], [args.new_tokens])) / args.new_tokens
    floor["batch1_floor_ms_per_token"] = one / floor["bandwidth_bytes_per_s"] * 1e3
    floor["batch1_floor_ms_per_token_at_copy_bandwidth"] = (
        one / floor["measured_copy_bandwidth_bytes_per_s"] * 1e3)
    result["floor"] = floor
    common.reuse_baselines(result, args)

    if not args.skip_w1:
        w1_lines(result, args, device, dtype)
    ctx = Context(prompts, args.new_tokens, k, target["successor"], device)
    paged_lines(result, args, target, drafts, ctx, dtype)
    common.free_memory()
    stock = replace(ctx, new_tokens=args.stock_new_tokens, plain_ms={})  # plain: hf_paged's
    stock_lines(result, args, target, drafts, stock, dtype)
    common.free_memory()
    common.finish(result)


def summary(data: dict) -> list[dict]:
    """One line per hf_paged run in tokens/s; a speculative batch-1 line's floor is plain
    decoding's (one read of the weights a token), which it may pass. transformers' lines sit
    beside hf_paged's like: plain, the same draft, prompt lookup on repeating prompts."""
    stock = data["baselines"]
    beside = {"plain_random": "transformers_generate",
              "prompt_lookup_repeating": "transformers_prompt_lookup"}
    assisted = stock.get("transformers_assisted", {}).get("changed_fraction")
    floor_per_s = 1e3 / data["floor"]["batch1_floor_ms_per_token"]
    copy_floor_per_s = 1e3 / data["floor"]["batch1_floor_ms_per_token_at_copy_bandwidth"]
    rows = []
    for label, fig in data["hf_paged"].items():
        if "error" in fig:
            continue
        if label.startswith("w1"):
            row = summary_row(
                "output tok/s, W1" + (" + ngram speculation" if label == "w1_ngram" else ""),
                fig["output_tokens_per_s"], {}, "output_tokens_per_s",
                floor=fig["output_tokens"] / fig["floor_s"], higher_is_better=True)
            if label == "w1_ngram" and "output_tokens_per_s" in data["hf_paged"].get("w1", {}):
                row["speedup_vs_plain"] = (fig["output_tokens_per_s"]
                                           / data["hf_paged"]["w1"]["output_tokens_per_s"])
            rows.append(row)
            continue
        name = beside.get(label)
        if label.startswith("draft_") and fig.get("changed_fraction") == assisted:
            name = "transformers_assisted"
        row = summary_row(
            f"batch-1 tok/s, {fig['description']}", fig["tokens_per_s"],
            {name: stock[name]} if name in stock else {}, "tokens_per_s", floor=floor_per_s,
            higher_is_better=True)
        row.update({key: fig.get(key) for key in (
            "acceptance", "per_token_acceptance", "tokens_per_step", "expected_tokens_per_step",
            "speedup_vs_plain", "matches_plain")})
        row["fraction_of_floor_at_copy_bandwidth"] = fig["tokens_per_s"] / copy_floor_per_s
        rows.append(row)
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, BASELINES)  # --model: W1's checkpoint
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/ckpt/speculation"),
                        help="folder of the target and draft checkpoints, built once")
    parser.add_argument("--target-shape", default="8b")
    parser.add_argument("--draft-shape", default="0.6b")
    # 0.13: about 70% of 4 drafts accepted (per-token agreement 0.87), the reference
    # point when acceptance is counted over proposed drafts; 0.3: 70% per-token agreement.
    parser.add_argument("--changed", type=float, nargs="+", default=[0.0, 0.13, 0.3, 0.5],
                        help="one draft per fraction f of the tokens it disagrees on")
    parser.add_argument("--stock-changed", type=float, default=0.3,
                        help="the draft of transformers' assisted generation (one of --changed)")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--stock-repeats", type=int, default=2)
    parser.add_argument("--stock-new-tokens", type=int, default=64)
    parser.add_argument("--cycle-len", type=int, default=64,
                        help="the short cycles that repeating prompts walk")
    parser.add_argument("--long-cycle-len", type=int, default=4096)
    parser.add_argument("--skip-self-draft", action="store_true",
                        help="no target-as-its-own-draft line (it loads a second target)")
    parser.add_argument("--skip-w1", action="store_true")
    parser.add_argument("--w1-num-requests", type=int)
    parser.add_argument("--w1-max-input-len", type=int)
    parser.add_argument("--w1-max-output-len", type=int)
    parser.add_argument("--w1-temperature", type=float, default=0.6)
    args = parser.parse_args(argv)
    if "assisted" in args.baselines and args.stock_changed not in args.changed:
        parser.error(f"--stock-changed {args.stock_changed} is not among --changed")
    if args.stock_new_tokens > args.new_tokens:
        parser.error("--stock-new-tokens may not exceed --new-tokens: transformers' outputs are "
                     "checked against the first tokens of hf_paged's plain ones")
    if args.prompt_len <= args.cycle_len:
        parser.error("--prompt-len must exceed --cycle-len: a repeating prompt walks its cycle "
                     "for longer than the cycle")
    return args


if __name__ == "__main__":
    main()
