"""Whether the engine can serve a request: ValueErrors that name the argument to change."""

from __future__ import annotations

from hf_paged.engine.block_manager import BlockManager


def check_request(prompt_token_ids: list[int], max_new_tokens: int, vocab_size: int,
                  max_model_len: int, blocks: BlockManager, memory: str) -> None:
    """Raise ValueError, naming the argument, for a request the engine cannot serve.
    ``memory``: the engine option that sizes the cache on this device."""
    if len(prompt_token_ids) == 0:
        raise ValueError("input_ids: the prompt is empty (no unpadded tokens)")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    _check_fits(len(prompt_token_ids), max_new_tokens, max_model_len, blocks, memory)


def check_fork_count(n: int, max_num_seqs: int) -> None:
    """Raise ValueError naming ``n`` unless ``n`` requests may fork from one prompt."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_num_seqs:
        raise ValueError(f"n must be an integer from 1 to max_num_seqs ({max_num_seqs}), "
                         f"got {n!r}")


def _check_fits(prompt_len: int, max_new_tokens: int, max_model_len: int, bm: BlockManager,
                memory: str) -> None:
    """Blame the prompt when it leaves no room for even one new token (no value of
    max_new_tokens could help), and max_new_tokens only when the prompt alone fits."""
    if prompt_len >= max_model_len:
        raise ValueError(
            f"input_ids: the prompt of {prompt_len} tokens leaves no room for a new token "
            f"within max_model_len ({max_model_len} tokens, prompt plus new tokens); "
            "shorten the prompt or raise max_model_len"
        )
    if bm.blocks_needed(prompt_len + 1) > bm.num_blocks:
        raise ValueError(
            f"input_ids: the prompt of {prompt_len} tokens (plus one new token) needs "
            f"{bm.blocks_needed(prompt_len + 1)} KV blocks but the whole cache has "
            f"{bm.num_blocks} ({bm.num_blocks * bm.block_size} tokens); shorten the prompt "
            f"or raise num_kv_blocks or {memory}"
        )
    total = prompt_len + max_new_tokens
    room = min(max_model_len, bm.num_blocks * bm.block_size) - prompt_len
    if total > max_model_len:
        raise ValueError(
            f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) = {total} exceeds max_model_len ({max_model_len}); "
            f"at most {room} new tokens fit after this prompt"
        )
    if bm.blocks_needed(total) > bm.num_blocks:
        raise ValueError(
            f"max_new_tokens: the request needs {bm.blocks_needed(total)} KV blocks but the "
            f"whole cache has {bm.num_blocks}; at most {room} new tokens fit after this "
            f"prompt: lower max_new_tokens or raise num_kv_blocks or {memory}"
        )
