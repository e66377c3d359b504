"""`hf-paged generate | make-checkpoint | run | serve | bench`."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

from hf_paged.checkpoint_shapes import SHAPES
from hf_paged.cli_run import front, one_line
from hf_paged.config import KV_CACHE_DTYPES
from hf_paged.lora.named import load_loras, parse_loras

DEFAULT_MODEL = Path.home() / ".cache" / "hf_paged" / "random-qwen3-tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-paged", description=__doc__)
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print hf_paged's version and the transformers and torch it runs "
                        "with, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a Qwen3 checkpoint")
    gen.add_argument("--model", help="checkpoint folder or hub id (default: a random tiny "
                     f"Qwen3, written to {DEFAULT_MODEL} on first use)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; needs the "
                     "checkpoint's tokenizer)")
    gen.add_argument("--token-ids", action="append", help="a prompt as comma-separated ids")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's)")
    gen.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model across this many GPUs (processes on CPU)")
    gen.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="the KV cache's dtype: auto (the model's) or fp8 (e4m3, scaled per KV "
                          "head: twice the tokens, half the bytes a decode step reads)")
    gen.add_argument("--lora", action="append", metavar="NAME=PATH",
                     help="load the LoRA adapter PEFT saved in folder PATH as NAME (repeatable)")
    gen.add_argument("--adapter", metavar="NAME",
                     help="generate with the adapter --lora loaded as NAME (default: the base "
                     "model)")
    gen.add_argument("--check", action="store_true",
                     help="also run stock transformers generate (with PEFT's adapter, for "
                     "--adapter) and compare the tokens (greedy only: sampled tokens differ "
                     "from run to run)")

    mk = sub.add_parser("make-checkpoint",
                        help="write a random Qwen3 or Qwen3-MoE checkpoint of a real shape")
    mk.add_argument("--shape", default="tiny", choices=list(SHAPES))
    mk.add_argument("--layers", type=int, help="decoder layers (default: the shape's own; "
                    "fewer make a large shape's checkpoint fit a disk, each layer unchanged)")
    mk.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--quantize", choices=["fp8"], help="fp8: the fine-grained FP8 layout of "
                    "Qwen's FP8 releases (128x128 blocks; the LM head and MoE routers float)")
    mk.add_argument("out")

    # run and serve parse their own arguments (most belong to the script or to transformers):
    # listed here for --help only.
    sub.add_parser("run", help="run a Python script, module (-m) or console command unchanged, "
                   "with transformers patched so that Qwen3 checkpoints load on hf_paged",
                   add_help=False)
    sub.add_parser("serve", help="transformers' own `transformers serve`, with Qwen3 "
                   "checkpoints on hf_paged", add_help=False)

    bench = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    bench.add_argument("name", choices=["throughput", "latency"])
    bench.add_argument("args", nargs=argparse.REMAINDER)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["run"], ["serve"]):
        return front(argv[0], argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.command == "make-checkpoint":
            from hf_paged.random_checkpoint import make_checkpoint

            print(make_checkpoint(args.shape, args.out, args.dtype, args.seed,
                                  layers=args.layers, quantize=args.quantize))
            return 0
        if args.command == "bench":
            return _bench(args.name, args.args)
        return _generate(args)
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        # Bad input: one line, no traceback.
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2


class _Version(argparse.Action):
    """``--version``: read when asked, so that other commands do not look the versions up."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import version

        import hf_paged

        print(f"hf-paged {hf_paged.__version__} (transformers {version('transformers')}, "
              f"torch {version('torch')})")
        parser.exit()


def _generate(args: argparse.Namespace) -> int:
    import torch

    from hf_paged import from_pretrained  # imported before the clock starts: it times loading

    model = args.model
    if model is None:
        model = str(DEFAULT_MODEL)
        if not (DEFAULT_MODEL / "tokenizer.json").exists():  # absent, or older: no tokenizer
            from hf_paged.random_checkpoint import make_checkpoint

            make_checkpoint("tiny", model, dtype="float32")
            print(f"wrote a random tiny Qwen3 checkpoint to {model} (reused from now on)")
    if args.check and args.kv_cache_dtype != "auto":
        raise ValueError("--check compares tokens with stock transformers, whose cache is not "
                         f"{args.kv_cache_dtype}: leave --kv-cache-dtype at auto")
    loras = parse_loras(args.lora or [])
    if args.adapter is not None and args.adapter not in loras:
        raise ValueError(f"--adapter {args.adapter}: no --lora loads an adapter of that name")
    t0 = time.perf_counter()
    path = _checkpoint_folder(model)
    engine = from_pretrained(path, dtype=args.dtype, device=args.device,
                             tensor_parallel_size=args.tensor_parallel_size,
                             kv_cache_dtype=args.kv_cache_dtype)
    load_loras(engine, loras)
    print(f"loaded {model}{''.join(f' +{name}' for name in loras)} on {engine.device} in "
          f"{time.perf_counter() - t0:.1f} s")
    tokenizer = _tokenizer(path)
    try:
        prompts = [[int(t) for t in ids.split(",")] for ids in args.token_ids or []]
    except ValueError:
        raise ValueError("--token-ids takes comma-separated integers, e.g. 1,2,3") from None
    if args.prompt:
        if tokenizer is None:
            print("error: --prompt needs a tokenizer in the checkpoint; use --token-ids",
                  file=sys.stderr)
            return 2
        for text in args.prompt:
            ids = tokenizer(text)["input_ids"]
            if not ids:  # stock generate() cannot start from nothing either
                raise ValueError(f"--prompt {text!r} tokenizes to no tokens; give some text")
            prompts.append(ids)
    if not prompts:  # the built-in demo: a few random prompts of different lengths
        gen = torch.Generator().manual_seed(0)
        vocab = engine.hf_config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    width = max(len(p) for p in prompts)
    pad = engine.generation_config.pad_token_id or 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {k: v for k, v in dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).items()
              if v is not None}
    if args.adapter is not None:  # PEFT's keyword: the adapter of each row
        kwargs["adapter_names"] = [args.adapter] * len(prompts)
    t0 = time.perf_counter()
    out = engine.generate(input_ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - t0
    _print_rows("hf_paged", out[:, width:], tokenizer)
    print(f"hf_paged: {out.shape[0]} sequences, {out[:, width:].numel()} new tokens in "
          f"{seconds:.2f} s")
    if args.check:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.dtype)
        if args.adapter is not None:
            from peft import PeftModel

            ref_model = PeftModel.from_pretrained(ref_model, loras[args.adapter],
                                                  adapter_name=args.adapter)
        ref = ref_model.to(engine.device).generate(input_ids.to(engine.device),
                                                   attention_mask=mask.to(engine.device),
                                                   **kwargs).cpu()
        _print_rows("transformers", ref[:, width:], tokenizer)
        if args.do_sample:
            print("parity with transformers: not compared: sampled tokens cannot be compared "
                  "token for token (each run draws its own); run without --do-sample to check")
            return 0
        same = torch.equal(ref, out)
        print("parity with transformers:", "identical tokens" if same else "DIFFERENT tokens")
        return 0 if same else 1
    return 0


def _checkpoint_folder(model: str) -> str:
    """``--model`` as a local checkpoint folder (a hub id downloaded), or a one-line error
    naming ``--model``."""
    from hf_paged.engine.loading import check_has_config, resolve_checkpoint

    try:
        path = resolve_checkpoint(model)
        check_has_config(path)
    except OSError as error:
        raise OSError(f"--model {error}") from error
    return path


def _print_rows(label: str, new_tokens, tokenizer) -> None:
    """Each row's new tokens, as text when there is a tokenizer, labelled by who made them."""
    for i, row in enumerate(new_tokens.tolist()):
        print(f"{label} [{i}]: {tokenizer.decode(row)!r}" if tokenizer else f"{label} [{i}]: {row}")


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    if os.path.isdir(model) and not any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError):
        return None


def _bench(name: str, args: list[str]) -> int:
    """Benchmarks live in the repository's benchmarks/ folder, next to the package."""
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        script = root / "benchmarks" / f"bench_{name}.py"
        if script.exists():
            sys.argv = [str(script), *args]
            sys.path.insert(0, str(root))
            os.chdir(root)
            runpy.run_path(str(script), run_name="__main__")
            return 0
    print("error: benchmarks/ not found; run from a checkout of the repository", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
