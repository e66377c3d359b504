"""The benchmark workloads: prompts as token-id lists and the new tokens asked of each.

Every function returns a ``Workload``, a ``(prompts, max_new_tokens)`` named tuple. Token ids are
drawn from ``[0, max_token_id]``; pass a smaller ``max_token_id`` for a checkpoint with a small
vocabulary. EOS is ignored everywhere, so each request generates exactly its ``max_new_tokens``.
"""

from __future__ import annotations

import random
from typing import NamedTuple

MAX_TOKEN_ID = 10000
W1_DEFAULTS = (256, 1024, 1024, MAX_TOKEN_ID)  # requests, input and output bounds, token ids
W1_OUTPUT_TOKENS = 133_966  # the total of W1's default output lengths (nano-vllm's bench)


class Workload(NamedTuple):
    prompts: list[list[int]]
    max_new_tokens: list[int]

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return Workload(self.prompts[:n], self.max_new_tokens[:n])

    def capped(self, n: int | None) -> Workload:
        """The same requests with at most ``n`` new tokens each (None: as they are)."""
        return self if n is None else Workload(self.prompts, [min(m, n)
                                                              for m in self.max_new_tokens])

    def dealt(self, parts: int) -> list[Workload]:
        """The requests dealt to ``parts`` data-parallel replicas by the engine's own rule
        (``data_parallel.deal``: heaviest first, prompt plus new tokens, to the least loaded)."""
        from hf_paged.integrations.data_parallel import deal

        weights = [len(p) + n for p, n in zip(self.prompts, self.max_new_tokens)]
        return [Workload([self.prompts[i] for i in rows], [self.max_new_tokens[i] for i in rows])
                for rows in deal(weights, [0] * parts) if rows]

    def requests(self) -> list[Workload]:
        """One workload per request."""
        return [Workload([p], [n]) for p, n in zip(self.prompts, self.max_new_tokens)]

    def common_prefix_len(self) -> int:
        """Length of the prefix that every prompt starts with."""
        first = self.prompts[0]
        n = min(map(len, self.prompts))
        for p in self.prompts[1:]:
            n = next((i for i in range(n) if p[i] != first[i]), n)
        return n

    def describe(self) -> dict[str, int]:
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens": sum(map(len, self.prompts)),
            "output_tokens": sum(self.max_new_tokens),
        }


def w1(
    num_requests: int = 256,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    max_token_id: int = MAX_TOKEN_ID,
) -> Workload:
    """W1 throughput: prompt lengths U[100, max_input_len], output lengths U[100, max_output_len].

    Drawn exactly as nano-vllm's bench does after ``random.seed(0)``: every prompt first, then
    every output length. With the defaults the outputs total 133,966 tokens.
    """
    rng = random.Random(0)
    prompts = [
        [
            rng.randint(0, max_token_id)
            for _ in range(rng.randint(min(100, max_input_len), max_input_len))
        ]
        for _ in range(num_requests)
    ]
    outputs = [rng.randint(min(100, max_output_len), max_output_len) for _ in range(num_requests)]
    defaults = (num_requests, max_input_len, max_output_len, max_token_id) == W1_DEFAULTS
    if defaults and sum(outputs) != W1_OUTPUT_TOKENS:
        raise RuntimeError(f"W1 draws {sum(outputs)} output tokens, expected {W1_OUTPUT_TOKENS}")
    return Workload(prompts, outputs)


def w2_decode(
    num_prompts: int = 1,
    prompt_len: int = 128,
    new_tokens: int = 256,
    max_token_id: int = MAX_TOKEN_ID,
) -> Workload:
    """W2 decode latency: batch 1, a ``prompt_len``-token prompt, ``new_tokens`` new tokens.

    One distinct prompt per repeat, so that no repeat is served from a prefix cache.
    """
    rng = random.Random(2)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(prompt_len)] for _ in range(num_prompts)
    ]
    return Workload(prompts, [new_tokens] * num_prompts)


def w2_ttft(
    num_prompts: int = 1, prompt_len: int = 1024, max_token_id: int = MAX_TOKEN_ID
) -> Workload:
    """W2 time to first token: batch 1, a ``prompt_len``-token prompt, one new token."""
    return w2_decode(num_prompts, prompt_len, 1, max_token_id)


def w3(
    num_requests: int = 256,
    prefix_len: int = 2048,
    unique_len: int = 32,
    new_tokens: int = 128,
    max_token_id: int = MAX_TOKEN_ID,
) -> Workload:
    """W3 shared prefix: one ``prefix_len``-token prefix + ``unique_len`` tokens per request."""
    rng = random.Random(3)
    prefix = [rng.randint(0, max_token_id) for _ in range(prefix_len)]
    prompts = [
        prefix + [rng.randint(0, max_token_id) for _ in range(unique_len)]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [new_tokens] * num_requests)


def warmup_requests(like: Workload, new_tokens: int = 16, seed: int = 1) -> Workload:
    """Fresh random prompts of the same lengths as ``like``'s, ``new_tokens`` each, sharing a
    fresh prefix as long as the one ``like``'s prompts share: they warm up a system
    (compilation, CUDA graphs of the same batch size, shared-prefix code paths) without
    seeding any prefix cache with the measured prompts (another ``seed``, other prompts)."""
    rng = random.Random(f"warm-up {seed}")  # never a workload's own stream (those seed ints)
    top = max(max(p) for p in like.prompts)
    shared = like.common_prefix_len() if len(like.prompts) > 1 else 0
    prefix = [rng.randint(0, top) for _ in range(shared)]
    prompts = [prefix + [rng.randint(0, top) for _ in p[shared:]] for p in like.prompts]
    return Workload(prompts, [new_tokens] * len(prompts))


def add_w1_and_batch1_args(parser) -> None:
    """The arguments of a benchmark that runs W1 (its requests, lengths and temperature, a
    baseline over its first requests in batches) and W2's batch-1 decode request."""
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--baseline-requests", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16, help="generate baseline's batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
