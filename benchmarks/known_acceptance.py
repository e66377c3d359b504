"""Target and draft checkpoints whose agreement is known, for the speculation benchmark (W6):
random weights make a draft's acceptance meaningless, so these models are built to follow a
token permutation instead.

Every layer's ``o_proj`` and ``down_proj`` is zero, so the residual stream carries the current
token's embedding unchanged through all layers (every weight is still read each step: a step
costs what the real shape's does), and the LM head is set so that the argmax of
``lm_head(norm(embed(x)))`` is ``successor[x]`` by a wide margin. The head is untied from the
embedding, also for shapes whose real model ties them (Qwen3-0.6B): a step reads the whole
head either way and only one embedding row, so it reads the same bytes. Greedy decoding then walks
``successor`` whatever the shape, so a target and a draft of different shapes agree wherever
their successors do. The target's successor is a permutation made of cycles: short ones (a
prompt that walks one for longer than its length makes a continuation that repeats the
prompt, which prompt lookup finds) and long ones (a prompt of random tokens from them makes a
continuation that repeats nothing). A draft's successor differs from the target's on a chosen
fraction ``f`` of the tokens, so each of its drafts is accepted with probability about
``1 - f``. The special tokens (padding, BOS, EOS) are fixed points, so no walk reaches EOS.

Each checkpoint folder holds ``successor.json`` (the successor, what it was built from, and the
target's cycles), so a folder is reused when it matches and every figure is checked against
the successor actually built.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_paged.random_checkpoint import random_qwen3, save_checkpoint, shape_config

SUCCESSOR_FILE = "successor.json"
TOP_LOGIT = 20.0  # the successor's logit; the others stay near 0 (random directions)


@dataclass(frozen=True)
class CycleSpec:
    """How the target's permutation is drawn: ``num_short`` cycles of ``cycle_len`` tokens,
    the other tokens in cycles of ``long_cycle_len`` (the last one takes the remainder)."""

    cycle_len: int = 64
    num_short: int = 16
    long_cycle_len: int = 4096
    seed: int = 0


def special_tokens(config) -> list[int]:
    """Padding, BOS, EOS and the ids between padding and EOS (Qwen3's <|im_start|>)."""
    ids = {config.bos_token_id, config.pad_token_id, config.eos_token_id}
    ids.update(range(config.pad_token_id, config.eos_token_id + 1))
    return sorted(i for i in ids if i is not None)


def draw_cycles(vocab_size: int, special: list[int], spec: CycleSpec) -> list[list[int]]:
    """The cycles of the target's permutation over every non-special token, short ones first."""
    fixed = set(special)
    tokens = [t for t in range(vocab_size) if t not in fixed]
    random.Random(spec.seed).shuffle(tokens)
    short = spec.num_short * spec.cycle_len
    if short > len(tokens) // 2:
        raise ValueError(f"{spec.num_short} cycles of {spec.cycle_len} take more than half of "
                         f"the {len(tokens)} tokens")
    cycles = [tokens[i : i + spec.cycle_len] for i in range(0, short, spec.cycle_len)]
    rest = tokens[short:]
    longs = [rest[i : i + spec.long_cycle_len] for i in range(0, len(rest), spec.long_cycle_len)]
    if len(longs) > 1 and len(longs[-1]) < spec.long_cycle_len:
        longs[-2] += longs.pop()  # no cycle shorter than long_cycle_len
    return cycles + longs


def successor_of(cycles: list[list[int]], vocab_size: int) -> list[int]:
    """Each token's successor along its cycle; tokens in no cycle are fixed points."""
    successor = list(range(vocab_size))
    for cycle in cycles:
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            successor[a] = b
    return successor


def perturbed(successor: list[int], special: list[int], fraction: float, seed: int) -> list[int]:
    """``successor`` changed on ``round(fraction * n)`` random non-special tokens: each of them
    takes the successor of the next one drawn (a cyclic shift), so the result is still a
    permutation and differs from ``successor`` exactly there. A larger fraction changes a
    superset of the tokens a smaller one changes (same seed)."""
    fixed = set(special)
    tokens = [t for t in range(len(successor)) if t not in fixed]
    random.Random(f"draft {seed}").shuffle(tokens)
    changed = tokens[: round(fraction * len(tokens))]
    result = list(successor)
    if len(changed) > 1:
        for a, b in zip(changed, changed[1:] + changed[:1]):
            result[a] = successor[b]
    return result


@torch.no_grad()
def follow_successor(model: PreTrainedModel, successor: list[int]) -> None:
    """Make greedy decoding of ``model`` walk ``successor`` (see the module's docstring)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    embed = model.model.embed_tokens.weight
    head = model.lm_head.weight
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("the LM head must be untied from the embedding")
    # norm(embed[x]) has length sqrt(hidden); head[successor[x]] points along it, so the
    # successor's logit is TOP_LOGIT and the others TOP_LOGIT times a random cosine (~0).
    unit = embed.float() / embed.float().norm(dim=1, keepdim=True)
    index = torch.tensor(successor, device=head.device)
    head[index] = (unit * (TOP_LOGIT / embed.shape[1] ** 0.5)).to(head.dtype)


def fingerprint(successor: list[int]) -> str:
    return hashlib.sha256(json.dumps(successor).encode()).hexdigest()[:16]


def read_successor(folder: Path) -> dict[str, Any] | None:
    path = folder / SUCCESSOR_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def ensure_checkpoint(folder: Path, shape: str, dtype: str, built_from: dict[str, Any],
                      recipe: Callable[[], dict[str, Any]], device: str,
                      seed: int = 0) -> dict[str, Any]:
    """The checkpoint at ``folder``: reused when its ``successor.json`` says it was built from
    ``built_from``, else (re)built from ``recipe()`` (its ``successor`` and facts to keep
    beside it). It is written aside and moved in whole, so a build cut short leaves none.
    Returns its ``successor.json``."""
    record = read_successor(folder)
    if record is not None and record["built_from"] == built_from:
        print(f"reusing {folder}")
        return record
    if folder.exists() and record is None:
        raise SystemExit(f"{folder} exists and holds no {SUCCESSOR_FILE}: not a checkpoint "
                         "this benchmark built; remove it or choose --checkpoints elsewhere")
    aside = folder.with_name(folder.name + ".partial")
    shutil.rmtree(aside, ignore_errors=True)
    made = recipe()
    config = shape_config(shape, dtype)
    config.tie_word_embeddings = False  # the head maps x to successor[x], not to x
    model = random_qwen3(config, seed, device=device)
    follow_successor(model, made["successor"])
    save_checkpoint(model, str(aside))
    del model
    record = {"built_from": built_from, "fingerprint": fingerprint(made["successor"]), **made}
    (aside / SUCCESSOR_FILE).write_text(json.dumps(record))
    shutil.rmtree(folder, ignore_errors=True)
    aside.rename(folder)
    print(f"built {folder}")
    return record


def build_pair(root: Path, target_shape: str, draft_shape: str, fractions: list[float],
               spec: CycleSpec, dtype: str, device: str) -> tuple[dict, dict[float, dict]]:
    """The target (``root/target-<shape>``) and one draft per changed fraction
    (``root/draft-<shape>-f<fraction>``), each reused when present and matching. Returns their
    ``successor.json`` records, each with its folder under ``path``."""
    config = shape_config(target_shape)
    if shape_config(draft_shape).vocab_size != config.vocab_size:
        raise SystemExit(f"shapes {target_shape} and {draft_shape} have different vocabularies")
    special = special_tokens(config)

    def target_recipe() -> dict[str, Any]:
        cycles = draw_cycles(config.vocab_size, special, spec)
        return {"successor": successor_of(cycles, config.vocab_size), "cycles": cycles,
                "num_short": spec.num_short, "special": special}

    target_dir = root / f"target-{target_shape}"
    record = ensure_checkpoint(target_dir, target_shape, dtype,
                               {"shape": target_shape, "dtype": dtype, "cycles": asdict(spec)},
                               target_recipe, device)
    target = dict(record, path=str(target_dir))
    drafts = {}
    for f in fractions:
        folder = root / f"draft-{draft_shape}-f{f:g}"
        built = {"shape": draft_shape, "dtype": dtype, "changed_fraction": f,
                 "target": record["fingerprint"]}

        def draft_recipe(f: float = f) -> dict[str, Any]:
            return {"successor": perturbed(record["successor"], special, f, spec.seed)}

        drafts[f] = dict(ensure_checkpoint(folder, draft_shape, dtype, built, draft_recipe,
                                           device, seed=spec.seed + 1), path=str(folder))
    return target, drafts


# ---- prompts and what greedy decoding must make of them -------------------------------------


def repeating_prompts(target: dict, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts, each walking a short cycle (prompt ``i`` the ``i``-th one, from a random
    token of it) for ``length`` tokens: longer than the cycle, so the continuation repeats it."""
    rng = random.Random(f"repeating {seed}")
    short = target["cycles"][: target["num_short"]]
    return [walk(target["successor"], rng.choice(short[i % len(short)]), length)
            for i in range(n)]


def random_prompts(target: dict, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random tokens of the long cycles: their continuations (walks along a
    long cycle) repeat nothing."""
    rng = random.Random(f"random {seed}")
    tokens = [t for cycle in target["cycles"][target["num_short"] :] for t in cycle]
    return [[rng.choice(tokens) for _ in range(length)] for _ in range(n)]


def walk(successor: list[int], start: int, length: int) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(successor[tokens[-1]])
    return tokens


def continuation(successor: list[int], prompt: list[int], new_tokens: int) -> list[int]:
    """The greedy continuation of ``prompt`` under ``successor``."""
    return walk(successor, successor[prompt[-1]], new_tokens)


def agreement(target: list[int], draft: list[int], prompts: list[list[int]],
              outputs: list[list[int]]) -> float:
    """The fraction of the tokens a draft had to continue from (each prompt's last token and
    each output token but the last) on which its successor is the target's: the per-token
    acceptance of its drafts along these very walks."""
    tokens = [t for p, o in zip(prompts, outputs) for t in [p[-1], *o[:-1]]]
    return sum(target[t] == draft[t] for t in tokens) / len(tokens)


# ---- what acceptance buys -------------------------------------------------------------------


def tokens_per_step(acceptance: float, drafts: float) -> float:
    """E[tokens a verify step keeps] for ``drafts`` drafts each accepted with probability
    ``acceptance`` (until the first rejection): ``(1 - a^(k+1)) / (1 - a)``."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


def acceptance_for(accepted_per_step: float, drafts: float) -> float:
    """The per-token acceptance ``a`` whose ``tokens_per_step(a, drafts) - 1`` is
    ``accepted_per_step`` (by bisection: it grows with ``a``)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_step(mid, drafts) - 1 < accepted_per_step \
            else (low, mid)
    return (low + high) / 2
