"""`hf-paged generate | make-checkpoint | run | bench`."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "hf_paged" / "random-qwen3-tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a Qwen3 checkpoint")
    gen.add_argument("--model", help="checkpoint folder or hub id (default: a built-in random "
                     "tiny Qwen3, created on first use)")
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
    gen.add_argument("--check", action="store_true",
                     help="also run stock transformers generate and compare the tokens")

    mk = sub.add_parser("make-checkpoint", help="write a random Qwen3 checkpoint")
    mk.add_argument("--shape", default="tiny", choices=["tiny", "0.6b", "1.7b", "8b"])
    mk.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("out")

    run = sub.add_parser("run", help="run a Python script unchanged, with transformers patched "
                         "so that Qwen3 checkpoints load on hf_paged")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")

    bench = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    bench.add_argument("name", choices=["throughput", "latency"])
    bench.add_argument("args", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.command == "run":
        return _run_script(args.script, args.args)
    try:
        if args.command == "make-checkpoint":
            from hf_paged.random_checkpoint import make_checkpoint

            print(make_checkpoint(args.shape, args.out, args.dtype, args.seed))
            return 0
        if args.command == "bench":
            return _bench(args.name, args.args)
        return _generate(args)
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        # Bad input: one line, no traceback.
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


def _run_script(script: str, args: list[str]) -> int:
    """Run ``script`` as ``__main__`` with ``args``, as ``python script args`` would, after
    ``patch_transformers()``. The script's own exceptions propagate as they would there."""
    if not os.path.isfile(script):
        print(f"error: run: no such script {script!r}", file=sys.stderr)
        return 2
    import hf_paged

    hf_paged.patch_transformers()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    import hf_paged

    model = args.model
    if model is None:
        model = str(DEFAULT_MODEL)
        if not (DEFAULT_MODEL / "tokenizer.json").exists():  # absent, or older: no tokenizer
            from hf_paged.random_checkpoint import make_checkpoint

            make_checkpoint("tiny", model, dtype="float32")
    t0 = time.perf_counter()
    path = _checkpoint_folder(model)
    engine = hf_paged.from_pretrained(path, dtype=args.dtype, device=args.device,
                                      tensor_parallel_size=args.tensor_parallel_size)
    print(f"loaded {model} on {engine.device} in {time.perf_counter() - t0:.1f} s")
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
    t0 = time.perf_counter()
    out = engine.generate(input_ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - t0
    _print_rows("hf_paged", out[:, width:], tokenizer)
    print(f"hf_paged: {out.shape[0]} sequences, {out[:, width:].numel()} new tokens in "
          f"{seconds:.2f} s")
    if args.check:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.runner.dtype)
        ref = ref_model.to(engine.device).generate(input_ids.to(engine.device),
                                                   attention_mask=mask.to(engine.device),
                                                   **kwargs).cpu()
        _print_rows("transformers", ref[:, width:], tokenizer)
        same = torch.equal(ref, out)
        print("parity with transformers:", "identical tokens" if same else "DIFFERENT tokens")
        return 0 if same else 1
    return 0


def _checkpoint_folder(model: str) -> str:
    """``--model`` as a local checkpoint folder (a hub id downloaded), or a one-line error
    naming ``--model``."""
    from hf_paged.engine.engine import resolve_checkpoint

    try:
        path = resolve_checkpoint(model)
    except OSError as error:
        raise OSError(f"--model {error}") from error
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise OSError(f"--model {model!r} is a folder without a config.json, not a checkpoint")
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
